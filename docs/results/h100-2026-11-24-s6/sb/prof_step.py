"""Kernel time of one training step by kernel name: torch.compile against a mirror plan."""
import sys, os, json, time, collections, warnings
warnings.filterwarnings("ignore")
import torch
import mirrorgrad
from mirrorgrad.bench.suites import get_workload
wl_name, method, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True
built = get_workload(wl_name).build(device="cuda", quick=False)
model = built.model
batch = built.make_batch()
if method == "compile":
    c = torch.compile(model)
else:
    kw = {"mode": "balance"} if method == "balance" else {"mode": "budget", "budget": float(method)}
    c = mirrorgrad.compile(model, **kw)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
def step():
    loss = c(*batch)
    loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
t = time.perf_counter(); step(); torch.cuda.synchronize(); cold = time.perf_counter() - t
for _ in range(3): step()
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(12)]
ts = []
for i in range(6):
    ev[2*i].record(); step(); ev[2*i+1].record()
torch.cuda.synchronize()
ts = sorted(ev[2*i].elapsed_time(ev[2*i+1]) for i in range(6))
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3): step()
    torch.cuda.synchronize()
k = collections.defaultdict(lambda: [0.0, 0])
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        k[e.name][0] += e.device_time / 3 / 1000; k[e.name][1] += 1
tot = sum(v[0] for v in k.values())
rows = sorted(k.items(), key=lambda kv: -kv[1][0])
os.makedirs(out, exist_ok=True)
with open(f"{out}/{wl_name}-{method}.txt", "w") as f:
    f.write(f"{wl_name} {method}: cold {cold:.1f}s, step ms min {ts[0]:.2f} median {ts[3]:.2f}; kernel ms/step {tot:.2f}, kernels/step {sum(v[1] for v in k.values())/3:.0f}\n")
    for name, (ms, n) in rows[:60]:
        f.write(f"{ms:8.3f} ms {n//3:5d}x  {name[:150]}\n")
print(f"{wl_name} {method}: cold {cold:.1f}s, step min {ts[0]:.2f} median {ts[3]:.2f} ms; kernel {tot:.2f} ms/step")
