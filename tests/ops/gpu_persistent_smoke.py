"""GPU smoke check of the persistent RNN layer: one small layer per mode and dtype, many
programs, against kernels.py; prints the layout, the compiled kernels and the max error.

    TRITON_INTERPRET=0 PYTHONPATH=src python tests/ops/gpu_persistent_smoke.py

Exits non-zero on a mismatch; a hang (the grid barrier) shows as the caller's timeout.
"""

import sys
import time

import torch

from mirrorgrad.ops.rnn import kernels, persistent, persistent_plan, persistent_probes
from mirrorgrad.ops.rnn.cell_modes import GATES
from mirrorgrad.ops.rnn.layer_call import LayerCall


def _layer(mode: str, dtype: torch.dtype, T: int, B: int, H: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    G = GATES[mode]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    s = 1.5 / H**0.5
    x, h0 = rand(T, B, H), rand(B, H, scale=0.5)
    c0 = rand(B, H) if mode == "lstm" else None
    w = (rand(G * H, H, scale=s), rand(G * H, H, scale=s), rand(G * H, scale=s),
         rand(G * H, scale=s))  # fmt: skip
    gy = rand(T, B, H)
    worst = 0.0
    outs = []
    for layer in (persistent, kernels):
        call = LayerCall(mode, x, h0, c0, *w, memory="stash")
        y, hn, cn, saved = layer.layer_forward(call)
        grads = layer.layer_backward(call, saved, y, gy, None, None)
        present = [t for t in (y, hn, cn, *grads[:7]) if t is not None]
        outs.append(present)
    for a, b in zip(*outs):
        err = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-3)
        worst = max(worst, err)
    return worst


CASES = (  # (mode, dtype, (T, B, H))
    ("lstm", torch.float32, (5, 20, 650)),  # streamed, 41 x 2 programs
    ("lstm", torch.float32, (3, 40, 128)),  # resident, 8 x 3 programs
    ("lstm", torch.bfloat16, (4, 4, 1024)),  # resident, 64 programs
    ("gru", torch.float32, (5, 20, 650)),  # resident, 41 x 2 programs
)


def _compiled(mode: str, dtype: torch.dtype, layout: persistent_plan.Plan) -> dict:
    return {
        f"{kind}{'' if lay.resident else '-streamed'}": (v["n_regs"], v["n_spills"])
        for (kind, m, dt, lay), v in persistent_probes.COMPILED.items()
        if m == mode and dt == dtype and lay.bn == layout.bn and lay.ka == layout.ka
    }


def main() -> int:
    bad = 0
    torch.backends.cuda.matmul.allow_tf32 = True  # what the benchmark runs (both sides)
    for mode, dtype, (T, B, H) in CASES:
        tol = 1e-2 if dtype == torch.float32 else 5e-2
        layout = persistent.plan(mode, B, H, dtype, torch.device("cuda"))
        t0 = time.perf_counter()
        err = _layer(mode, dtype, T, B, H)
        torch.cuda.synchronize()
        bad += err > tol
        print(f"{mode:8} {str(dtype)[6:]:8} T{T} B{B} H{H}: rel err {err:.2e} "
              f"{'ok' if err <= tol else 'MISMATCH'} ({time.perf_counter() - t0:.1f} s) "
              f"programs {layout.programs}x{layout.groups} bb {layout.bb} resident "
              f"{layout.resident} compiled {_compiled(mode, dtype, layout)}",
              flush=True)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
