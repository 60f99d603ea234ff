"""The drop-in RNNs never break: every implementation under every way a user runs it, on
the GPU, in one command (about 5 minutes on an H100 with 16 cores).

    python tests/gpu_matrix.py --out OUT [--jobs 14] [--modes LSTM,GRU,RNN]
                               [--dtypes fp32,bf16] [--batches 1,4,20,128,256]
                               [--impls reference,triton,persistent,cudnn,auto,cuda]

Cases: LSTM/GRU/RNN x fp32/bf16 x batch x impl (reference, triton, persistent, cudnn,
auto, and cuda for LSTMs at the batches it takes) x path:
- ``eager``: the module as it is;
- ``compile``: ``torch.compile`` (Inductor, its defaults);
- ``reduce-overhead``: ``torch.compile(mode="reduce-overhead")`` (CUDA Graph trees);
- ``mirrorgrad-cudagraphs``: ``mirrorgrad.compile(options={"triton.cudagraphs": True})``;
- ``step-graph``: forward, backward and the SGD step captured in one ``torch.cuda.graph``.

The model: a 2-layer RNN (no dropout, so every path computes one function), a linear head
and cross-entropy. Each case's parameter gradients are compared with the same weights and
inputs in float64 through ``torch.nn`` on the CPU: the largest of ||g - ref|| / ||ref||
over parameters must stay under 1e-3 (fp32: TF32 is left off) or 2e-2 (bf16). Graphed
paths must replay: Inductor records no cudagraph skip, and the step graph replays three
times with finite losses. Then a word LM (dropout 0.5, embedding
650, batch 4, 20 and 128) under ``torch.compile`` and ``mirrorgrad.compile`` balance:
no error, gradients equal eager's with the same seed (``fallback_random``).

One worker process per (mode, dtype, impl) runs its cases (``--jobs`` at once; each
compiles its own graphs). Writes OUT/matrix.json and OUT/matrix.md (logs in OUT/workers/),
prints each worker's pass counts and failures as it ends, then every failure last; exits 1 if
any case failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

IMPLS = ("reference", "triton", "persistent", "cudnn", "auto", "cuda")
PATHS = ("eager", "compile", "reduce-overhead", "mirrorgrad-cudagraphs", "step-graph")
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}
# impl="cuda" runs fp32 with TF32 recurrent products (as cuDNN's default), whatever
# allow_tf32 says: 10 mantissa bits against bf16's 7, so a tolerance between the two.
CUDA_FP32_TOLERANCE = 1e-2
T, INPUT, HIDDEN, CLASSES, LAYERS = 8, 96, 256, 50, 2


def _model(mode, impl, dtype):
    import torch
    from torch import nn

    import mirrorgrad.nn as mnn

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(mnn, mode)(INPUT, HIDDEN, LAYERS, impl=impl)
            self.head = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x, y):
            h, _ = self.rnn(x)
            logits = self.head(h).float()
            return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    return Tagger().cuda().to(dtype)


def _reference_grads(model, mode, x, y):
    """float64 gradients of the same weights and inputs through torch.nn (cuDNN)."""
    from torch import nn

    rnn = getattr(nn, mode)(INPUT, HIDDEN, LAYERS).cuda().double()
    rnn.load_state_dict({k: v.double() for k, v in model.rnn.state_dict().items()})
    head = nn.Linear(HIDDEN, CLASSES).cuda().double()
    head.load_state_dict({k: v.double() for k, v in model.head.state_dict().items()})
    h, _ = rnn(x.double())
    loss = nn.functional.cross_entropy(head(h).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {f"rnn.{n}": p.grad for n, p in rnn.named_parameters()}
    grads.update({f"head.{n}": p.grad for n, p in head.named_parameters()})
    return grads


def _error(model, reference) -> float:
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.double()
        ref = reference[name]
        worst = max(worst, ((g - ref).norm() / ref.norm().clamp_min(1e-30)).item())
    return worst


def _path(path, model):
    import torch

    import mirrorgrad

    if path == "compile":
        return torch.compile(model)
    if path == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    if path == "mirrorgrad-cudagraphs":
        return mirrorgrad.compile(model, mode="balance", options={"triton.cudagraphs": True})
    return model


def _run_eager_or_compiled(model, fn, path, x, y, reference) -> dict:
    import torch
    from torch._dynamo.utils import counters

    for _ in range(3):  # the third call runs what the first two compiled and recorded
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        loss = fn(x, y)
        loss.backward()
    torch.cuda.synchronize()
    skips = counters["inductor"]["cudagraph_skips"]  # a skipped graph runs uncaptured
    out = {"error": _error(model, reference), "loss": loss.item()}
    if path in ("reduce-overhead", "mirrorgrad-cudagraphs") and skips:
        out["failure"] = f"Inductor skipped CUDA Graphs ({skips}x)"
    return out


def _run_step_graph(model, x, y, reference) -> dict:
    """Forward, backward and SGD captured in one torch.cuda.graph; replayed from the
    initial weights (gradients compared), then twice more."""
    import torch

    initial = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = model(x, y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(initial[name])
    graph.replay()
    torch.cuda.synchronize()
    out = {"error": _error(model, reference), "loss": loss.item()}
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    if not torch.isfinite(loss).item():
        out["failure"] = f"non-finite loss after replays: {loss.item()}"
    return out


def _inputs(batch, dtype):
    import torch

    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(T, batch, INPUT, generator=gen).to("cuda", dtype)
    return x, torch.randint(0, CLASSES, (T, batch), generator=gen).cuda()


def worker(mode: str, dtype_name: str, impl: str, batches: list[int], result_path: Path) -> None:
    """Every path and batch of one (mode, dtype, impl); every model starts from the same
    weights (seed 0), so one float64 reference per batch serves all."""
    import torch
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    tolerance = TOLERANCE[dtype_name]
    if impl == "cuda":
        from mirrorgrad.ops.rnn import cuda_persistent

        device = torch.device("cuda")
        batches = [b for b in batches
                   if cuda_persistent.unsupported_reason("lstm", proj=False, dtype=dtype,
                                                         device=device, hidden=HIDDEN,
                                                         batch=b) is None]  # fmt: skip
        tolerance = CUDA_FP32_TOLERANCE if dtype_name == "fp32" else tolerance
    references = {b: _reference_grads(_model(mode, "cudnn", dtype), mode, *_inputs(b, dtype))
                  for b in batches}  # fmt: skip
    results = []
    for path in PATHS:
        torch._dynamo.reset()
        counters.clear()
        model = _model(mode, impl, dtype)
        fn = _path(path, model)
        for batch in batches:
            case = dict(mode=mode, dtype=dtype_name, impl=impl, path=path, batch=batch)
            start = time.perf_counter()
            try:
                x, y = _inputs(batch, dtype)
                if path == "step-graph":  # a fresh model: the replays moved the weights
                    outcome = _run_step_graph(_model(mode, impl, dtype), x, y, references[batch])
                else:
                    outcome = _run_eager_or_compiled(model, fn, path, x, y, references[batch])
                case.update(outcome)
                if "failure" not in case and not case["error"] <= tolerance:
                    case["failure"] = f"gradient error {case['error']:.2e}"
            except Exception as e:  # a case that raises is a failure, reported whole
                case["failure"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                case["traceback"] = traceback.format_exc()[-3000:]
                torch.cuda.synchronize()
            case["seconds"] = round(time.perf_counter() - start, 2)
            results.append(case)
            result_path.write_text(json.dumps(results, indent=1))
    result_path.write_text(json.dumps(results, indent=1))


def snippet(result_path: Path) -> None:
    """A word LM (dropout 0.5, the shape that once broke the op) under torch.compile
    and mirrorgrad.compile."""
    import torch
    from torch import nn

    import mirrorgrad
    from mirrorgrad.ops.rnn import dispatch

    results = []
    for how in ("torch.compile", "mirrorgrad.compile"):
        for batch in (4, 20, 128):
            case = dict(mode="LSTM", dtype="fp32", impl="auto", path=f"snippet {how}", batch=batch)
            try:
                torch._dynamo.reset()
                dispatch._AUTO_CHOICE.clear()
                torch.manual_seed(0)
                emb = nn.Embedding(10000, 650).cuda()
                rnn = mirrorgrad.nn.LSTM(650, 650, 2, dropout=0.5).cuda()
                dec = nn.Linear(650, 10000).cuda()
                modules = nn.ModuleList([emb, rnn, dec])

                def f(x, y, emb=emb, rnn=rnn, dec=dec):
                    h, _ = rnn(emb(x))
                    return nn.functional.cross_entropy(dec(h).flatten(0, 1), y.flatten())

                options = {"fallback_random": True}  # eager's dropout seed, for comparison
                if how == "torch.compile":
                    g = torch.compile(f, options=options)
                else:
                    g = mirrorgrad.compile(f, mode="balance", options=options)
                x = torch.randint(0, 10000, (35, batch), device="cuda")
                y = torch.randint(0, 10000, (35, batch), device="cuda")
                f(x, y)  # eager's first call: impl="auto" times its candidates
                case["eager_pick"] = sorted(set(dispatch._AUTO_CHOICE.values()))
                grads = []
                for fn in (g, f):
                    modules.zero_grad(set_to_none=True)
                    torch.manual_seed(1)
                    fn(x, y).backward()
                    grads.append([p.grad.double() for p in modules.parameters()])
                case["error"] = max(((a - b).norm() / b.norm()).item() for a, b in zip(*grads))
                finite = all(torch.isfinite(t).all().item() for t in grads[0])
                if not finite:
                    case["failure"] = "non-finite compiled gradients"
                elif "cudnn" in case["eager_pick"]:
                    case["note"] = "eager ran cuDNN (its own masks): compared for finiteness only"
                elif not case["error"] <= 1e-3:
                    case["failure"] = f"compiled gradients differ from eager's: {case['error']:.2e}"
            except Exception as e:
                case["failure"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                case["traceback"] = traceback.format_exc()[-3000:]
            results.append(case)
            result_path.write_text(json.dumps(results, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=14)
    parser.add_argument("--modes", default="LSTM,GRU,RNN")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--batches", default="1,4,20,128,256")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        mode, dtype, impl, result = args.worker
        if mode == "snippet":
            snippet(Path(result))
        else:
            worker(mode, dtype, impl, batches, Path(result))
        return 0
    work = args.out / "workers"  # one log and one JSON per worker
    work.mkdir(parents=True, exist_ok=True)
    # the CUDA C++ kernel runs LSTMs only
    jobs = [(m, d, i) for m in args.modes.split(",") for d in args.dtypes.split(",")
            for i in args.impls.split(",") if i != "cuda" or m == "LSTM"]
    jobs.sort(key=lambda job: job[2] != "cudnn")  # the longest first: torch's RNN compiles unrolled
    jobs.insert(1, ("snippet", "fp32", "auto"))
    pending, running, start = list(jobs), [], time.perf_counter()
    finished: dict[tuple, list] = {}  # job -> its cases, read once as the worker ends
    while pending or running:
        while pending and len(running) < args.jobs:
            mode, dtype, impl = job = pending.pop(0)
            result = work / f"{'-'.join(job)}.json"
            log = open(work / f"{'-'.join(job)}.log", "w")  # noqa: SIM115 (the worker's)
            cmd = [sys.executable, __file__, "--out", str(args.out), "--batches", args.batches,
                   "--worker", mode, dtype, impl, str(result)]  # fmt: skip
            env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="2")
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                            job))  # fmt: skip
        time.sleep(2)
        for process, job in list(running):
            if process.poll() is not None:
                running.remove((process, job))
                # Each worker's counts and failures as it ends: a run cut short still tells.
                result = work / f"{'-'.join(job)}.json"
                got = finished[job] = json.loads(result.read_text()) if result.exists() else []
                bad = [c for c in got if "failure" in c]
                print(f"[{time.perf_counter() - start:4.0f} s] {' '.join(job)}: exit "
                      f"{process.returncode}, {len(got) - len(bad)} passed, {len(bad)} failed",
                      flush=True)  # fmt: skip
                for c in bad:
                    print(f"  FAIL {c['path']} B={c['batch']}: {c['failure']}", flush=True)
    cases = []
    for job in jobs:
        got = finished[job]
        if not got:
            mode, dtype, impl = job
            got = [dict(mode=mode, dtype=dtype, impl=impl, path="-", batch=0,
                        failure=f"worker wrote nothing: see {'-'.join(job)}.log")]  # fmt: skip
        cases += got
    (args.out / "matrix.json").write_text(json.dumps(cases, indent=1))
    failed = [c for c in cases if "failure" in c]
    lines = ["| mode | dtype | impl | path | passed | failed |", "|---|---|---|---|---:|---:|"]
    groups: dict[tuple, list] = {}
    for c in cases:
        groups.setdefault((c["mode"], c["dtype"], c["impl"], c["path"]), []).append(c)
    for key, group in groups.items():
        bad = sum("failure" in c for c in group)
        lines.append(f"| {' | '.join(map(str, key))} | {len(group) - bad} | {bad} |")
    (args.out / "matrix.md").write_text("\n".join(lines) + "\n")
    for c in failed:
        print(f"FAIL {c['mode']} {c['dtype']} impl={c['impl']} {c['path']} B={c['batch']}: "
              f"{c['failure']}")  # fmt: skip
    print(f"GPU matrix: {len(cases) - len(failed)} passed, {len(failed)} failed "
          f"in {time.perf_counter() - start:.0f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
