"""GPU benchmark of the fused RNN kernels against cuDNN (plain and CUDA-Graph-captured).

    python -m mirrorgrad.bench.rnn_kernels --dtype fp32|bf16 --out DIR

For every (mode, config) of issue 3's table: correctness against float64 first, then
forward+backward median time, stash bytes (allocated after forward minus before) and
peak bytes of forward+backward, for

* ``cudnn``         torch.nn.LSTM / GRU / RNN;
* ``cudnn-graph``   the same forward+backward captured whole in one CUDA Graph;
* ``split-nograph`` ops.rnn.kernels, cuBLAS hidden GEMM + pointwise kernel per step, host launches;
* ``fused-nograph`` ops.rnn.kernels, hidden GEMM inside the step kernel, host launches;
* ``split``, ``fused`` the same with ops.rnn.graphs' per-layer CUDA Graph of the step loop;
* ``auto``          ops.rnn.kernels' defaults (what the op runs), memory="stash";
* ``recompute``     auto with memory="recompute";
* ``auto-graph``    auto with the whole forward+backward captured in one CUDA Graph;
* ``fused-bwd``     split forward, fused backward, per-layer graphs;
* ``module``        mirrorgrad.nn.<Mode>(impl="triton") end to end, when it imports.

Writes ``DIR/rnn_kernels_<dtype>.json`` and ``.md``; prints the markdown table last.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from mirrorgrad.bench.provenance import git_commit
from mirrorgrad.ops.rnn import graphs, kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_MODULES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}
METHODS = (
    "cudnn",
    "cudnn-graph",
    "split-nograph",
    "fused-nograph",
    "split",
    "fused",
    "auto",
    "recompute",
    "auto-graph",
    "fused-bwd",
    "module",
)
OURS = ("split-nograph", "fused-nograph", "split", "fused", "auto", "recompute", "fused-bwd")


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    layers: int
    input: int
    hidden: int
    batch: int
    T: int
    bidirectional: bool = False

    @property
    def name(self) -> str:
        bi = " bi" if self.bidirectional else ""
        return f"L{self.layers} I{self.input} H{self.hidden} B{self.batch} T{self.T}{bi}"


# Issue 3's table: (layers, input, hidden, batch, T) [, bidirectional].
CONFIGS = (
    Config(layers=2, input=650, hidden=650, batch=20, T=35),
    Config(layers=2, input=1500, hidden=1500, batch=20, T=35),
    Config(layers=2, input=1024, hidden=1024, batch=64, T=50),
    Config(layers=4, input=1024, hidden=1024, batch=128, T=50),
    Config(layers=1, input=512, hidden=512, batch=16, T=100),
    Config(layers=2, input=512, hidden=512, batch=256, T=35),
    Config(layers=2, input=1024, hidden=1024, batch=64, T=50, bidirectional=True),
)


def _torch_rnn(mode: str, cfg: Config, dtype: torch.dtype) -> torch.nn.RNNBase:
    cls = getattr(torch.nn, TORCH_MODULES[mode])
    kwargs = {"nonlinearity": mode[4:]} if mode.startswith("rnn") else {}
    return cls(cfg.input, cfg.hidden, cfg.layers, bidirectional=cfg.bidirectional, **kwargs).to(
        "cuda", dtype
    )


def _layer_params(rnn: torch.nn.RNNBase, layer: int, direction: int) -> list[Tensor]:
    sfx = f"_l{layer}" + ("_reverse" if direction else "")
    return [
        getattr(rnn, f"{name}{sfx}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    ]


def _stack_forward_backward(
    mode: str,
    rnn: torch.nn.RNNBase,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    grad_y: Tensor,
    fused_bwd: bool | None = None,
    **opts,
) -> tuple[Tensor, list[Tensor], Tensor, list[Tensor]]:
    """Layers x directions of ops.rnn.kernels' contract, as the op composes them (no dropout).

    ``fused_bwd`` overrides ``fused`` for the backward. Returns (y, [h_n, c_n], grad_x,
    parameter grads in rnn.parameters() order).
    """
    bwd_opts = opts if fused_bwd is None else opts | {"fused": fused_bwd}
    D = 2 if rnn.bidirectional else 1
    inp, record, h_n, c_n = x, [], [], []
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(D):
            k = layer * D + d
            w_ih, w_hh, b_ih, b_hh = _layer_params(rnn, layer, d)
            xin = inp.flip(0) if d else inp
            c = c0[k] if c0 is not None else None
            y, hn, cn, saved = kernels.layer_forward(
                mode, xin, h0[k], c, w_ih, w_hh, b_ih, b_hh, None, **opts
            )
            record.append((xin, h0[k], c, (w_ih, w_hh, b_ih, b_hh), y, saved))
            outs.append(y.flip(0) if d else y)
            h_n.append(hn)
            c_n.append(cn)
        inp = torch.cat(outs, -1) if D == 2 else outs[0]
    y_out = inp
    grads: dict[int, list[Tensor]] = {}
    g = grad_y
    for layer in reversed(range(rnn.num_layers)):
        g_in = None
        for d in range(D):
            k = layer * D + d
            xin, h0k, c, weights, y, saved = record[k]
            gy = g[..., d * rnn.hidden_size : (d + 1) * rnn.hidden_size]
            gy = gy.flip(0) if d else gy
            out = kernels.layer_backward(
                mode, saved, xin, h0k, c, *weights, None, y, gy, None, None, **bwd_opts
            )
            gx = out[0].flip(0) if d else out[0]
            g_in = gx if g_in is None else g_in + gx
            grads[k] = list(out[3:7])
        g = g_in
    flat = [t for k in range(rnn.num_layers * D) for t in grads[k]]
    return y_out, h_n + [c for c in c_n if c is not None], g, flat


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(mode: str, dtype: torch.dtype) -> dict[str, float]:
    """Relative error of cuDNN and of ops.rnn.kernels against float64, on one mid-size shape."""
    cfg = Config(layers=2, input=96, hidden=128, batch=8, T=12, bidirectional=True)
    torch.manual_seed(0)
    rnn = _torch_rnn(mode, cfg, dtype)
    ref = _torch_rnn(mode, cfg, torch.float64).cpu()
    ref.load_state_dict({k: v.double().cpu() for k, v in rnn.state_dict().items()})
    x = torch.randn(cfg.T, cfg.batch, cfg.input, device="cuda", dtype=dtype)
    gy = torch.randn(cfg.T, cfg.batch, 2 * cfg.hidden, device="cuda", dtype=dtype)
    D = 2
    h0 = torch.zeros(cfg.layers * D, cfg.batch, cfg.hidden, device="cuda", dtype=dtype)
    c0 = torch.zeros_like(h0) if mode == "lstm" else None

    xr = x.double().cpu().requires_grad_()
    yr, _ = ref(xr)
    ref_grads = torch.autograd.grad(yr, [xr, *ref.parameters()], gy.double().cpu())

    xc = x.clone().requires_grad_()
    yc, _ = rnn(xc)
    cu_grads = torch.autograd.grad(yc, [xc, *rnn.parameters()], gy)

    results = {}
    for memory in ("stash", "recompute"):
        for fused in (False, True):
            yt, _, gx, pg = _stack_forward_backward(
                mode, rnn, x, h0, c0, gy, memory=memory, fused=fused
            )
            errs = [_rel(yt, yr), _rel(gx, ref_grads[0])]
            errs += [_rel(a, b) for a, b in zip(pg, ref_grads[1:])]
            results[f"{'fused' if fused else 'split'}-{memory}"] = max(errs)
    results["cudnn"] = max([_rel(yc, yr)] + [_rel(a, b) for a, b in zip(cu_grads, ref_grads)])
    return results


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _memory(fwd: Callable[[], object], bwd: Callable[[object], object]) -> tuple[int, int, int]:
    """(stash: allocated after forward minus before, peak of forward+backward minus before,
    backward's extra: its peak minus what was allocated when it started), after a warm-up."""
    bwd(fwd())  # compiles kernels and captures graphs outside the measured window
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = fwd()
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    fwd_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = bwd(state)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated()
    del state, out
    return after_fwd - before, max(fwd_peak, bwd_peak) - before, bwd_peak - after_fwd


def _graphed(step: Callable[[], object]) -> Callable[[], None]:
    """Capture ``step`` (static inputs) in one CUDA Graph; return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _module_rnn(mode: str, rnn: torch.nn.RNNBase) -> torch.nn.Module | None:
    try:
        from mirrorgrad import nn as mgnn

        cls = getattr(mgnn, TORCH_MODULES[mode])
        kwargs = {"nonlinearity": mode[4:]} if mode.startswith("rnn") else {}
        mod = cls(
            rnn.input_size,
            rnn.hidden_size,
            rnn.num_layers,
            bidirectional=rnn.bidirectional,
            impl="triton",
            **kwargs,
        )
        mod = mod.to("cuda", rnn.weight_ih_l0.dtype)
        mod.load_state_dict(rnn.state_dict())
        return mod
    except Exception as err:  # the module is optional here: report, do not fail the run
        print(f"module column skipped: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def bench_config(
    mode: str, cfg: Config, dtype: torch.dtype, reps: int, methods: tuple[str, ...] = METHODS
) -> dict:
    torch.manual_seed(0)
    rnn = _torch_rnn(mode, cfg, dtype)
    D = 2 if cfg.bidirectional else 1
    x = torch.randn(cfg.T, cfg.batch, cfg.input, device="cuda", dtype=dtype)
    gy = torch.randn(cfg.T, cfg.batch, D * cfg.hidden, device="cuda", dtype=dtype)
    h0 = torch.randn(cfg.layers * D, cfg.batch, cfg.hidden, device="cuda", dtype=dtype)
    c0 = torch.randn_like(h0) if mode == "lstm" else None
    hx = (h0, c0) if mode == "lstm" else h0
    params = list(rnn.parameters())
    xg = x.clone().requires_grad_()

    def cudnn_fwd():
        return rnn(xg, hx)[0]

    def cudnn_bwd(y):
        return torch.autograd.grad(y, [xg, *params], gy)

    def cudnn_step():
        return cudnn_bwd(cudnn_fwd())

    def ours(memory: str = "stash", use_graph: bool | None = None, fused: bool | None = None):
        return lambda: _stack_forward_backward(
            mode, rnn, x, h0, c0, gy, memory=memory, use_graph=use_graph, fused=fused
        )

    row: dict = {"mode": mode, "config": asdict(cfg), "ms": {}, "stash_bytes": {}, "peak_bytes": {}}

    def module_step():
        module = _module_rnn(mode, rnn)
        if module is None:
            return None
        mparams = list(module.parameters())
        return lambda: torch.autograd.grad(module(xg, hx)[0], [xg, *mparams], gy)

    # Factories: a graph is captured only for the methods asked for.
    factories = {
        "cudnn": lambda: cudnn_step,
        "cudnn-graph": lambda: _graphed(cudnn_step),
        "split-nograph": lambda: ours(use_graph=False, fused=False),
        "fused-nograph": lambda: ours(use_graph=False, fused=True),
        "split": lambda: ours(use_graph=True, fused=False),
        "fused": lambda: ours(use_graph=True, fused=True),
        "auto": ours,
        "recompute": lambda: ours("recompute"),
        "auto-graph": lambda: _graphed(ours(use_graph=False)),
        "fused-bwd": lambda: (
            lambda: _stack_forward_backward(
                mode, rnn, x, h0, c0, gy, use_graph=True, fused=False, fused_bwd=True
            )
        ),
        "module": module_step,
    }
    for name in methods:
        try:
            step = factories[name]()
            row["ms"][name] = _time(step, reps) if step is not None else None
        except Exception as err:  # one failing method must not hide the others
            row["ms"][name] = None
            print(f"{mode} {cfg.name} {name}: {type(err).__name__}: {err}", file=sys.stderr)
        step = None
    row["stash_bytes"]["cudnn"], row["peak_bytes"]["cudnn"], _ = _memory(cudnn_fwd, cudnn_bwd)
    for name, memory in (("auto", "stash"), ("recompute", "recompute")):
        row["stash_bytes"][name], row["peak_bytes"][name], _ = _memory(
            *_split_ours(mode, rnn, x, h0, c0, gy, memory)
        )
    return row


def _split_ours(mode, rnn, x, h0, c0, gy, memory):
    """Forward and backward of one layer stack as two calls, for the memory probe."""
    D = 2 if rnn.bidirectional else 1

    def fwd():
        inp, record = x, []
        for layer in range(rnn.num_layers):
            outs = []
            for d in range(D):
                k = layer * D + d
                weights = _layer_params(rnn, layer, d)
                xin = inp.flip(0) if d else inp
                c = c0[k] if c0 is not None else None
                y, _, _, saved = kernels.layer_forward(
                    mode, xin, h0[k], c, *weights, None, memory=memory
                )
                record.append((xin, c, weights, y, saved))
                outs.append(y.flip(0) if d else y)
            inp = torch.cat(outs, -1) if D == 2 else outs[0]
        return record

    def bwd(record):
        g = gy
        for layer in reversed(range(rnn.num_layers)):
            g_in = None
            for d in range(D):
                k = layer * D + d
                xin, c, weights, y, saved = record[k]
                gyk = g[..., d * rnn.hidden_size : (d + 1) * rnn.hidden_size]
                out = kernels.layer_backward(
                    mode,
                    saved,
                    xin,
                    h0[k],
                    c,
                    *weights,
                    None,
                    y,
                    gyk.flip(0) if d else gyk,
                    None,
                    None,
                    memory=memory,
                )
                gx = out[0].flip(0) if d else out[0]
                g_in = gx if g_in is None else g_in + gx
            g = g_in
        return g

    return fwd, bwd


def profile(mode: str, cfg: Config, dtype: torch.dtype, steps: int = 5) -> str:
    """GPU time per kernel of ops.rnn.kernels' default path after warm-up (torch.profiler)."""
    torch.manual_seed(0)
    rnn = _torch_rnn(mode, cfg, dtype)
    D = 2 if cfg.bidirectional else 1
    x = torch.randn(cfg.T, cfg.batch, cfg.input, device="cuda", dtype=dtype)
    gy = torch.randn(cfg.T, cfg.batch, D * cfg.hidden, device="cuda", dtype=dtype)
    h0 = torch.randn(cfg.layers * D, cfg.batch, cfg.hidden, device="cuda", dtype=dtype)
    c0 = torch.randn_like(h0) if mode == "lstm" else None
    for _ in range(3):
        _stack_forward_backward(mode, rnn, x, h0, c0, gy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _stack_forward_backward(mode, rnn, x, h0, c0, gy)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=12, max_name_column_width=60
    )
    return f"{mode} {cfg.name} {dtype}, {steps} fwd+bwd:\n{table}"


def _cudnn_probe(rnn, xg, hx, gy):
    """Forward and backward of the torch module as two calls, for the memory probe."""
    return (
        lambda: rnn(xg, hx)[0],
        lambda y: torch.autograd.grad(y, [xg, *rnn.parameters()], gy),
    )


def backward_memory_vs_T(mode: str, dtype: torch.dtype) -> list[dict]:
    """Backward's extra memory (its peak minus what it started with) as T grows 64x.

    It includes the input gradient (T*B*I elements), as cuDNN's does.
    """
    rows = []
    # Past T = BWD_CHUNK_ROWS / B (410 here) backward keeps dG for one chunk only.
    for T in (35, 560, 2240):
        cfg = Config(layers=2, input=650, hidden=650, batch=20, T=T)
        rnn = _torch_rnn(mode, cfg, dtype)
        x = torch.randn(T, cfg.batch, cfg.input, device="cuda", dtype=dtype)
        gy = torch.randn(T, cfg.batch, cfg.hidden, device="cuda", dtype=dtype)
        h0 = torch.randn(cfg.layers, cfg.batch, cfg.hidden, device="cuda", dtype=dtype)
        c0 = torch.randn_like(h0) if mode == "lstm" else None
        xg = x.clone().requires_grad_()
        hx = (h0, c0) if mode == "lstm" else h0
        probes = {
            "cudnn": _cudnn_probe(rnn, xg, hx, gy),
            "stash": _split_ours(mode, rnn, x, h0, c0, gy, "stash"),
            "recompute": _split_ours(mode, rnn, x, h0, c0, gy, "recompute"),
        }
        for name, (fwd, bwd) in probes.items():
            stash, peak, extra = _memory(fwd, bwd)
            rows.append(
                {"mode": mode, "T": T, "method": name, "stash_bytes": stash, "peak_bytes": peak}
                | {"backward_extra_bytes": extra}
            )
        graphs.clear_graphs()
    return rows


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _mb(d: dict) -> str:
    return " / ".join(f"{d[k] / 2**20:.1f}" for k in ("cudnn", "auto", "recompute"))


def markdown(result: dict) -> str:
    r0 = result
    lines = [
        f"GPU: {r0['gpu']}; torch {r0['torch']}, triton {r0['triton']}, dtype {r0['dtype']}, "
        f"matmul.allow_tf32={r0['allow_tf32']}, cudnn.allow_tf32={r0['cudnn_allow_tf32']}, "
        f"commit {r0['commit']}",
        f"Command: `{r0['command']}`",
        "",
        "Correctness (max relative error vs float64 over y and every gradient): "
        + "; ".join(
            f"{m}: " + ", ".join(f"{k} {v:.1e}" for k, v in c.items())
            for m, c in r0["check"].items()
        ),
        "",
    ]
    cols = [m for m in METHODS if any(r["ms"].get(m) is not None for r in r0["rows"])]
    head = ["mode", "config", *(f"{c} ms" for c in cols), "auto vs cudnn", "vs cudnn-graph"]
    head += ["best triton vs cudnn", "auto-graph vs cudnn-graph"]
    head += ["stash MB cudnn / stash / recompute", "peak MB cudnn / stash / recompute"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios: dict[str, dict[str, list[float]]] = {}
    for r in r0["rows"]:
        ms, sb, pb = r["ms"], r["stash_bytes"], r["peak_bytes"]
        ours = [ms[m] for m in OURS if ms.get(m) is not None]
        best = min(ours) if ours else None
        auto, cu, cug = ms.get("auto"), ms.get("cudnn"), ms.get("cudnn-graph")
        vs = auto and cu and cu / auto
        vsg = auto and cug and cug / auto
        vbest = best and cu and cu / best
        vgg = ms.get("auto-graph") and cug and cug / ms["auto-graph"]
        per = ratios.setdefault(
            r["mode"], {"cudnn": [], "graph": [], "best": [], "gg": [], "rstash": [], "rtime": []}
        )
        for key, v in (("cudnn", vs), ("graph", vsg), ("best", vbest), ("gg", vgg)):
            if v:
                per[key].append(v)
        if sb.get("cudnn"):
            per["rstash"].append(sb["recompute"] / sb["cudnn"])
        if ms.get("recompute") and auto:
            per["rtime"].append(ms["recompute"] / auto)
        cells = [r["mode"], Config(**r["config"]).name, *(_fmt(ms.get(c)) for c in cols)]
        cells += [f"{_fmt(v)}x" for v in (vs, vsg, vbest, vgg)] + [_mb(sb), _mb(pb)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for mode, per in ratios.items():
        lines.append(
            f"- {mode}: geomean speedup of auto over cudnn {_geomean(per['cudnn']):.2f}x, "
            f"over cudnn-graph {_geomean(per['graph']):.2f}x; best triton over cudnn "
            f"{_geomean(per['best']):.2f}x; auto-graph / cudnn-graph {_geomean(per['gg']):.2f}x; "
            "recompute stash / cudnn stash "
            f"{_geomean(per['rstash']):.2f}; recompute / stash time {_geomean(per['rtime']):.2f}"
        )
    if r0.get("backward_memory"):
        lines += [
            "",
            "Backward's extra memory (its peak minus its start; includes dx), L2 H650 B20:",
        ]
        lines += ["", "| method | T | stash MB | backward extra MB |", "|---|---|---|---|"]
        for b in r0["backward_memory"]:
            stash, extra = b["stash_bytes"] / 2**20, b["backward_extra_bytes"] / 2**20
            lines.append(f"| {b['method']} | {b['T']} | {stash:.1f} | {extra:.1f} |")
    return "\n".join(lines) + "\n"


def _write(out: Path, dtype: str, result: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rnn_kernels_{dtype}.json").write_text(json.dumps(result, indent=1, default=str))
    table = markdown(result)
    (out / f"rnn_kernels_{dtype}.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--modes", default="lstm,gru,rnn_tanh", help="comma-separated of " + ",".join(TORCH_MODULES)
    )
    parser.add_argument(
        "--configs", default="all", help="'all' or comma-separated indices into the table (0-6)"
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--profile", action="store_true", help="print a kernel-time profile of auto instead"
    )
    parser.add_argument(
        "--skip-memory-vs-t", action="store_true", help="skip the backward memory vs T probe"
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of " + ",".join(METHODS),
    )
    parser.add_argument(
        "--tf32",
        choices=("match-cudnn", "on", "off"),
        default="match-cudnn",
        help="torch.backends.cuda.matmul.allow_tf32; match-cudnn: as cudnn.allow_tf32, so that "
        "both sides do the same fp32 arithmetic (cuDNN's RNN uses TF32 by default)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    modes = args.modes.split(",")
    methods = tuple(args.methods.split(","))
    for name in methods:
        if name not in METHODS:
            parser.error(f"unknown method {name!r}; choose from {','.join(METHODS)}")
    for mode in modes:
        if mode not in TORCH_MODULES:
            parser.error(f"unknown mode {mode!r}; choose from {','.join(TORCH_MODULES)}")
    configs = (
        CONFIGS
        if args.configs == "all"
        else tuple(CONFIGS[int(i)] for i in args.configs.split(","))
    )
    tf32 = {"on": True, "off": False, "match-cudnn": torch.backends.cudnn.allow_tf32}[args.tf32]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if args.tf32 == "off":
        torch.backends.cudnn.allow_tf32 = False
    dtype = DTYPES[args.dtype]
    import triton

    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "dtype": args.dtype,
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "commit": (git_commit()[0] or "unknown")[:7],
        "command": "python -m mirrorgrad.bench.rnn_kernels "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "check": {},
        "rows": [],
    }
    if args.profile:
        for mode in modes:
            for cfg in configs:
                print(profile(mode, cfg, dtype))
        return 0
    for mode in modes:
        result["check"][mode] = check(mode, dtype)
        print(mode, "check", result["check"][mode], flush=True)
    # A wrong kernel's speed is not reported.
    tol = 1e-2 if dtype == torch.float32 else 5e-2
    bad = {
        m: c
        for m, c in result["check"].items()
        if max(v for k, v in c.items() if k != "cudnn") > max(tol, 5 * c["cudnn"])
    }
    if bad:
        print(f"correctness check failed, no timings: {bad}", file=sys.stderr)
    for mode in (m for m in modes if m not in bad):
        for cfg in configs:
            row = bench_config(mode, cfg, dtype, args.reps, methods)
            result["rows"].append(row)
            print(mode, cfg.name, {k: _fmt(v) for k, v in row["ms"].items()}, flush=True)
            _write(args.out, args.dtype, result)  # partial results survive a time limit
            graphs.clear_graphs()
            torch.cuda.empty_cache()
    if "lstm" in modes and "lstm" not in bad and not args.skip_memory_vs_t:
        result["backward_memory"] = backward_memory_vs_T("lstm", dtype)
    table = _write(args.out, args.dtype, result)
    print(table)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
