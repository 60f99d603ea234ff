"""What the RNN op's ``memory="recompute"`` saves and costs, against ``memory="stash"`` and cuDNN.

    python benchmarks/rnn_memory_modes.py --out DIR [--dtype fp32 bf16] [--quick]
    python benchmarks/rnn_memory_modes.py --from-json A.json B.json

``mirrorgrad.nn.LSTM/GRU/RNN(impl="triton")`` with ``memory="stash"`` and
``memory="recompute"``, beside ``torch.nn``'s module (cuDNN; GPU only), all with the same
weights; a step is the forward, then the gradients of the input and the weights for a
random output gradient. Two measurements:

1. per mode (LSTM, GRU, RNN-tanh), dtype and configuration (``rnn_modules.CONFIGS``):
   each module's stash and backward extra, and the step's time in stash and recompute
   mode (``time_calls``, the two modes in alternating rounds);
2. an LSTM, L2 H650 B20 fp32, at T 35, 560 and 2240: the stash and the backward extra
   of the three, as T grows 64x.

"stash": the bytes the forward allocates and still holds when it returns (its output
included): cuDNN's reserve space as torch exposes it, the op's saved tensors. "backward
extra": the backward's peak minus what was allocated when it started (the gradients
included). Both by the CUDA allocator, after a warm-up step (kernels compiled, the op's
step loops captured). On the CPU there is no allocator: stash is the bytes of the
storages autograd saves that the forward allocated, and backward extra is not measured.
Gradients of every module are checked against ``torch.nn``'s in float64 first.

Writes DIR/rnn_memory_modes.json after every row (a run stopped early keeps what it
measured); prints both tables last, as docs/BENCHMARKS.md shows them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import mirrorgrad.nn
from mirrorgrad._timing import Timing, synchronize, time_calls
from mirrorgrad._units import format_bytes
from mirrorgrad.bench.provenance import git_commit
from mirrorgrad.bench.rnn_modules import CONFIGS, QUICK, SUITE_MODES, TORCH_MODULES, Config
from mirrorgrad.bench.runner import DTYPES, SavedStorageBytes

MODE_NAMES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN-tanh"}
MEMORY_MODES = ("stash", "recompute")
# The backward-memory study: the language-model LSTM as T grows.
T_CONFIG = Config(layers=2, input=650, hidden=650, batch=20)
T_STEPS = (35, 560, 2240)
QUICK_T_STEPS = (3, 12)
# Relative gradient error against float64 past which a module's numbers are not trusted
# (or 5x cuDNN's, where that is larger).
GRAD_TOLERANCE = {"fp32": 1e-2, "bf16": 5e-2}
MiB = 2**20


@dataclasses.dataclass(kw_only=True, slots=True)
class Case:
    """One stack shape with its inputs: ``x`` (a leaf needing its gradient), the initial
    state ``hx`` and the output gradient."""

    mode: str
    cfg: Config
    dtype: str
    reference: nn.RNNBase  # torch.nn's module: cuDNN on the GPU
    x: Tensor
    hx: Tensor | tuple[Tensor, Tensor]
    grad_y: Tensor

    @classmethod
    def build(cls, mode: str, cfg: Config, dtype: str, device: torch.device) -> Case:
        torch.manual_seed(0)
        kwargs = {"nonlinearity": mode[4:]} if mode.startswith("rnn") else {}
        reference = TORCH_MODULES[mode](
            cfg.input, cfg.hidden, cfg.layers, bidirectional=cfg.bidirectional, **kwargs
        )
        reference = reference.to(device, DTYPES[dtype])
        D = 2 if cfg.bidirectional else 1

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, device=device, dtype=DTYPES[dtype])

        h0 = randn(cfg.layers * D, cfg.batch, cfg.hidden)
        hx = (h0, randn(*h0.shape)) if mode == "lstm" else h0
        x = randn(cfg.T, cfg.batch, cfg.input).requires_grad_()
        grad_y = randn(cfg.T, cfg.batch, D * cfg.hidden)
        return cls(mode=mode, cfg=cfg, dtype=dtype, reference=reference, x=x, hx=hx, grad_y=grad_y)

    def modules(self) -> dict[str, nn.RNNBase]:
        """cuDNN's (on a GPU) and ours in each memory mode, on the same weights."""
        ours = {
            m: mirrorgrad.nn.convert(self.reference, impl="triton", memory=m) for m in MEMORY_MODES
        }
        return ({"cudnn": self.reference} if self.x.is_cuda else {}) | ours

    def forward(self, module: nn.RNNBase) -> Callable[[], Tensor]:
        return lambda: module(self.x, self.hx)[0]

    def backward(self, module: nn.RNNBase) -> Callable[[Tensor], tuple[Tensor, ...]]:
        wrt = [self.x, *module.parameters()]
        return lambda y: torch.autograd.grad(y, wrt, self.grad_y)

    def float64_gradients(self) -> tuple[Tensor, ...]:
        """torch.nn's gradients in float64, on this device."""
        module = copy.deepcopy(self.reference).double()
        x = self.x.detach().double().requires_grad_()
        hx = tuple(h.double() for h in self.hx) if self.mode == "lstm" else self.hx.double()
        y = module(x, hx)[0]
        return torch.autograd.grad(y, [x, *module.parameters()], self.grad_y.double())


def relative_error(grads: tuple[Tensor, ...], reference: tuple[Tensor, ...]) -> float:
    """The largest ||g - ref|| / ||ref|| over the tensors."""
    return max(
        ((g.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        for g, r in zip(grads, reference, strict=True)
    )


def memory(case: Case, module: nn.RNNBase) -> dict[str, int | None]:
    """The module's stash and backward extra (bytes); on a GPU after a warm-up step (the
    op's step loops captured at the addresses this step's tensors get)."""
    forward, backward = case.forward(module), case.backward(module)
    device = case.x.device
    if device.type != "cuda":
        hx = list(case.hx) if case.mode == "lstm" else [case.hx]
        saved = SavedStorageBytes([case.x, *hx, *module.parameters()])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            y = forward()
        backward(y)
        return {"stash_bytes": saved.total, "backward_extra_bytes": None}
    backward(forward())
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    y = forward()
    synchronize(device)
    at_backward = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = backward(y)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del y, grads
    return {"stash_bytes": at_backward - before, "backward_extra_bytes": peak - at_backward}


def _step(forward: Callable[[], Tensor], backward: Callable[[Tensor], object]) -> object:
    return backward(forward())


def step_times(case: Case, modules: dict[str, nn.RNNBase], reps: int, rounds: int = 2):
    """Per memory mode, forward + backward ms, in ``rounds`` alternating rounds (the order
    flips each round, so drift of clocks and load hits both modes alike)."""
    samples: dict[str, list[float]] = {m: [] for m in MEMORY_MODES}
    for r in range(rounds):
        for m in MEMORY_MODES if r % 2 == 0 else MEMORY_MODES[::-1]:
            step = functools.partial(_step, case.forward(modules[m]), case.backward(modules[m]))
            timing = time_calls(step, repeats=reps, device=case.x.device, warmup=1)
            samples[m] += timing.samples_ms
    return {m: Timing.of(s) for m, s in samples.items()}


def measure(case: Case, *, reps: int | None) -> dict[str, Any]:
    """A row: per module its gradient error against float64, stash and backward extra;
    with ``reps``, the stash and recompute steps' times."""
    reference = case.float64_gradients()
    modules = case.modules()
    methods: dict[str, dict[str, Any]] = {}
    for name, module in modules.items():
        grads = case.backward(module)(case.forward(module)())
        methods[name] = {"grad_error": relative_error(grads, reference)}
        del grads
        methods[name] |= memory(case, module)
    if reps:
        for name, timing in step_times(case, modules, reps).items():
            methods[name] |= {
                "median_ms": timing.median_ms,
                "p20_ms": timing.p20_ms,
                "p80_ms": timing.p80_ms,
            }
    return {
        "mode": case.mode,
        "dtype": case.dtype,
        "config": dataclasses.asdict(case.cfg),
        "methods": methods,
    }


def wrong_gradients(row: dict[str, Any]) -> list[str]:
    """Our modules whose gradient error is past the dtype's tolerance (or 5x cuDNN's)."""
    cudnn = row["methods"].get("cudnn", {}).get("grad_error", 0.0)
    limit = max(GRAD_TOLERANCE[row["dtype"]], 5 * cudnn)
    return [m for m in MEMORY_MODES if row["methods"][m]["grad_error"] > limit]


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def mode_table(rows: list[dict[str, Any]]) -> str:
    """Per mode and dtype, geometric means over the configurations: recompute's stash over
    cuDNN's, and recompute's step time over stash's."""
    lines = [
        "| mode | dtype | recompute stash / cuDNN stash | recompute time / stash time |",
        "|---|---|---:|---:|",
    ]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for dtype in dict.fromkeys(r["dtype"] for r in rows if r["mode"] == mode):
            ms = [r["methods"] for r in rows if (r["mode"], r["dtype"]) == (mode, dtype)]
            stash = [
                m["recompute"]["stash_bytes"] / m["cudnn"]["stash_bytes"]
                for m in ms
                if "cudnn" in m
            ]
            time = [
                m["recompute"]["median_ms"] / m["stash"]["median_ms"]
                for m in ms
                if "median_ms" in m["stash"]
            ]
            cells = [MODE_NAMES[mode], dtype, _ratio(_geomean(stash)), _ratio(_geomean(time))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mb(n: int | None) -> str:
    return "—" if n is None else f"{n / MiB:.1f}"


def t_table(rows: list[dict[str, Any]]) -> str:
    """Per T: each module's stash / backward extra, MB."""
    head = ["T", *(f"{name} stash / backward extra MB" for name in ("cuDNN", "ours", "recompute"))]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---|"]
    for r in rows:
        cells = [str(r["config"]["T"])]
        for name in ("cudnn", "stash", "recompute"):
            m = r["methods"].get(name)
            cells.append(
                "—" if m is None else f"{_mb(m['stash_bytes'])} / {_mb(m['backward_extra_bytes'])}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(doc: dict[str, Any]) -> str:
    """Both tables, each under a line that says what it holds."""
    cfg = Config(**doc["t_rows"][0]["config"]) if doc["t_rows"] else None
    configs = {Config(**r["config"]).name for r in doc["rows"]}
    out = [
        f'Geometric mean over {len(configs)} configurations, impl="triton":',
        "",
        mode_table(doc["rows"]),
    ]
    if cfg is not None:
        out += [
            "",
            f"LSTM L{cfg.layers} H{cfg.hidden} B{cfg.batch} fp32 as T grows "
            "(backward extra: the backward's peak minus its start, gradients included):",
            "",
            t_table(doc["t_rows"]),
        ]
    return "\n".join(out)


def _summary(name: str, m: dict[str, Any]) -> str:
    """One module's numbers in a row's progress line."""
    ms = f", {m['median_ms']:.2f} ms" if "median_ms" in m else ""
    return (
        f"{name}: stash {format_bytes(m['stash_bytes'])}, backward extra "
        f"{format_bytes(m['backward_extra_bytes'])}{ms}, gradient error "
        f"{m['grad_error']:.1e}"
    )


def _environment(device: torch.device) -> dict[str, Any]:
    commit, dirty = git_commit()
    env = {
        "device": str(device),
        "torch": torch.__version__,
        "commit": commit,
        "dirty": dirty,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cuda":
        import triton

        env |= {
            "gpu": torch.cuda.get_device_name(device),
            "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version(),
        }
    return env


def _clear_loop_graphs(device: torch.device) -> None:
    """Drop the op's captured step loops and their arenas between shapes."""
    if device.type == "cuda":
        from mirrorgrad.ops.rnn import cuda_graphs

        cuda_graphs.clear_graphs()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the JSON goes (required to measure)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--modes", nargs="+", choices=SUITE_MODES, default=list(SUITE_MODES))
    parser.add_argument(
        "--reps", type=int, default=10, help="timed steps per memory mode and round (two rounds)"
    )
    parser.add_argument(
        "--t-steps",
        type=int,
        nargs="*",
        default=None,
        help=f"the LSTM's T for the second table (default {T_STEPS}; none: skip it)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny shapes ({QUICK.name}; T {QUICK_T_STEPS}), one rep a round: a "
        "smoke test (on the CPU through the Triton interpreter)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="run nothing: print both tables from these files' rows (runs split by --dtype)",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        docs = [json.loads(f.read_text()) for f in args.from_json]
        print(tables({k: [r for d in docs for r in d[k]] for k in ("rows", "t_rows")}))
        return 0
    if args.out is None:
        parser.error("--out is required to measure")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or (
        device.type == "cuda" and not torch.cuda.is_available()
    ):
        parser.error(f"--device must be the CPU or a GPU torch sees here, got {args.device!r}")
    torch.set_float32_matmul_precision("high")  # TF32, as cuDNN's RNNs use by default
    configs = [QUICK] if args.quick else list(CONFIGS)
    reps = 1 if args.quick else args.reps
    t_steps = (
        args.t_steps if args.t_steps is not None else (QUICK_T_STEPS if args.quick else T_STEPS)
    )
    t_config = dataclasses.replace(QUICK, bidirectional=False) if args.quick else T_CONFIG
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rnn_memory_modes.json"
    doc = {
        "command": "python benchmarks/rnn_memory_modes.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": _environment(device),
        "rows": [],
        "t_rows": [],
    }
    work = [
        ("rows", mode, cfg, dtype, reps)
        for mode in args.modes
        for dtype in args.dtype
        for cfg in configs
    ]
    work += [("t_rows", "lstm", dataclasses.replace(t_config, T=T), "fp32", None) for T in t_steps]
    wrong = []
    for table, mode, cfg, dtype, row_reps in work:
        row = measure(Case.build(mode, cfg, dtype, device), reps=row_reps)
        doc[table].append(row)
        wrong += [
            f"{mode} {dtype} {cfg.name} {m}: {row['methods'][m]['grad_error']:.1e}"
            for m in wrong_gradients(row)
        ]
        print(
            f"{mode} {dtype} {cfg.name}: "
            + "; ".join(_summary(name, m) for name, m in row["methods"].items()),
            flush=True,
        )
        path.write_text(json.dumps(doc, indent=1))
        _clear_loop_graphs(device)
    print()
    print(tables(doc))
    if wrong:
        print(
            "gradients off against float64 (rows not to be trusted): " + "; ".join(wrong),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
