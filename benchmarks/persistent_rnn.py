"""Kernel-level benchmark of the persistent RNN layer (ops/rnn/persistent.py) on one GPU.

    python benchmarks/persistent_rnn.py --out DIR [--dtypes fp32,bf16]
        [--modes lstm,gru] [--configs 0,4,7] | [--cases lstm:fp32:0,gru:bf16:7]
        [--methods ...] [--reps 10] [--profile] [--sweep] [--knobs best_knobs.json]

Forward + backward median ms (``mirrorgrad._timing``) of one stack at the shapes of
``CONFIGS`` (the rnn-modules suite's seven shapes, then batch 1-4), TF32 on
both sides in fp32 (``matmul.allow_tf32 = cudnn.allow_tf32 = True``). Methods:

* ``cudnn``: ``torch.nn.LSTM/GRU``; ``cudnn-graph``: its forward+backward captured in
  one CUDA Graph and replayed;
* ``triton`` / ``persistent`` / ``auto``: ``mirrorgrad.nn.LSTM/GRU(impl=...)``, what users
  call (``auto``: the row records what it timed and picked, ``dispatch.AUTO_TIMES``);
* ``layer-triton`` / ``layer-persistent``: the per-layer functions called directly
  (no module, no autograd) in the module's memory mode.

TFLOP/s counts the gate GEMMs (3x the forward's) and is given as a share of the GPU's
dense peak; each row also records the persistent layout, its compiled kernels
(registers, spills, shared memory) and the grid barrier's cost alone (``barrier_us``).
``--profile`` adds a torch.profiler table. ``--phases`` times the module and the layer
with the VARIANTS knob sets (old, new) and splits each step of every program into phases
(hidden GEMM, gates, arrival, barrier wait: the kernels' PROBE stamps) and prints
their medians in microseconds. ``--sweep`` times the SWEEP knob
sets at the layer level and writes the best to ``best_knobs.json``; ``--knobs`` applies
such a file first. Writes ``persistent_rnn.json``; prints a table last. About 8 s per
row and method set on an H100 (most of it compiling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

from mirrorgrad._timing import time_calls
from mirrorgrad.bench import rnn_modules
from mirrorgrad.bench.rnn_modules import Config, step_flops
from mirrorgrad.bench.runner import dense_peak_tflops
from mirrorgrad.ops.rnn.layer_call import LayerCall
from mirrorgrad.ops.rnn.persistent_kernels import grid_barrier
from mirrorgrad.ops.rnn.tuning import PersistentTuning, active, tuned

# The module suite's shapes, then small batches: where a persistent kernel, which keeps
# the weights on chip across steps, pays most.
CONFIGS = (
    *rnn_modules.CONFIGS,
    Config(layers=1, input=1024, hidden=1024, batch=4, T=100),
    Config(layers=1, input=2048, hidden=2048, batch=4, T=100),
    Config(layers=2, input=1152, hidden=1152, batch=4, T=100),
    Config(layers=2, input=1024, hidden=1024, batch=1, T=100),
)
METHODS = ("cudnn", "cudnn-graph", "triton", "persistent", "auto", "layer-triton",
           "layer-persistent")  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _modules(mode: str, cfg: Config, dtype: torch.dtype,
             impls=("triton", "persistent", "auto")) -> dict[str, torch.nn.Module]:  # fmt: skip
    """torch.nn's module and mirrorgrad's per impl, all with the same weights."""
    import mirrorgrad.nn

    cls = {"lstm": (torch.nn.LSTM, mirrorgrad.nn.LSTM), "gru": (torch.nn.GRU, mirrorgrad.nn.GRU)}
    plain, ours = cls[mode]
    args = (cfg.input, cfg.hidden, cfg.layers)
    base = plain(*args, bidirectional=cfg.bidirectional).cuda().to(dtype)
    out = {"cudnn": base}
    for impl in impls:
        m = ours(*args, bidirectional=cfg.bidirectional, impl=impl).cuda().to(dtype)
        m.load_state_dict(base.state_dict())
        out[impl] = m
    return out


def _auto_step(module: torch.nn.Module, x: Tensor, gy: Tensor) -> Callable[[], None]:
    """``_module_step`` of an ``impl="auto"`` module, its pick made afresh (the cached
    picks and times cleared: ``_measure`` records this row's)."""
    from mirrorgrad.ops.rnn import dispatch

    dispatch._AUTO_CHOICE.clear()
    dispatch.AUTO_TIMES.clear()
    return _module_step(module, x, gy)


def _module_step(module: torch.nn.Module, x: Tensor, gy: Tensor) -> Callable[[], None]:
    def step() -> None:
        y, _ = module(x)
        torch.autograd.backward(y, gy)

    return step


def _graphed(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured once in a CUDA Graph (after warm-up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _layer_step(impl: str, mode: str, module: torch.nn.Module, x: Tensor, gy: Tensor):
    """Forward of every layer, then backward down the stack, the layer functions alone,
    in the memory mode the module picks (LSTM: recompute)."""
    forward, backward = _layer_passes(impl, mode, module, x, gy)

    def step() -> None:
        backward(forward())

    return step


def _layer_passes(impl: str, mode: str, module: torch.nn.Module, x: Tensor, gy: Tensor):
    """(forward, backward) of ``_layer_step``: forward() returns what backward(record)
    takes (each layer-direction's input, output and saved tensors)."""
    from mirrorgrad.ops.rnn import kernels, persistent
    from mirrorgrad.ops.rnn.op import resolve_memory

    layer = persistent if impl == "persistent" else kernels
    D = 2 if module.bidirectional else 1
    H, L = module.hidden_size, module.num_layers
    weights = [module._flat_weights[i * 4 : i * 4 + 4] for i in range(L * D)]
    B = x.shape[1]
    h0 = x.new_zeros(B, H)
    c0 = h0 if mode == "lstm" else None
    memory = resolve_memory("auto", mode)

    def forward() -> list:
        inp, record = x, []
        for k in range(L):
            outs = []
            for d in range(D):
                xin = inp.flip(0) if d else inp
                call = LayerCall(mode, xin, h0, c0, *weights[k * D + d], memory=memory)
                y, _, _, saved = layer.layer_forward(call)
                record.append((call, y, saved))
                outs.append(y.flip(0) if d else y)
            inp = torch.cat(outs, -1) if D == 2 else outs[0]
        return record

    def backward(record: list) -> None:
        g = gy
        for k in reversed(range(L)):
            g_in = None
            for d in range(D):
                call, y, saved = record[k * D + d]
                gd = g[..., d * H : (d + 1) * H]
                out = layer.layer_backward(call, saved, y, gd.flip(0) if d else gd, None, None)
                gx = out[0].flip(0) if d else out[0]
                g_in = gx if g_in is None else g_in + gx
            g = g_in

    return forward, backward


def _steps(mode: str, cfg: Config, dtype: torch.dtype, methods) -> dict[str, Callable]:
    torch.manual_seed(0)
    mods = _modules(mode, cfg, dtype)
    D = 2 if cfg.bidirectional else 1
    x = torch.randn(cfg.T, cfg.batch, cfg.input, device="cuda", dtype=dtype, requires_grad=True)
    gy = torch.randn(cfg.T, cfg.batch, D * cfg.hidden, device="cuda", dtype=dtype)
    makers = {
        "cudnn": lambda: _module_step(mods["cudnn"], x, gy),
        "cudnn-graph": lambda: _graphed(_module_step(mods["cudnn"], x, gy)),
        "triton": lambda: _module_step(mods["triton"], x, gy),
        "persistent": lambda: _module_step(mods["persistent"], x, gy),
        "auto": lambda: _auto_step(mods["auto"], x, gy),
        "layer-triton": lambda: _layer_step("triton", mode, mods["triton"], x.detach(), gy),
        "layer-persistent": lambda: _layer_step(
            "persistent", mode, mods["persistent"], x.detach(), gy
        ),
    }
    return {name: makers[name] for name in methods}


@triton.jit
def _barrier_probe(count_ptr, T, SPIN_LOAD: tl.constexpr):
    t = tl.program_id(0) * 0
    while t < T:
        t += 1
        grid_barrier(count_ptr, t * tl.num_programs(0), SPIN_LOAD)


def barrier_us(programs: int, spin_load: bool, steps: int = 1000) -> float:
    """Microseconds per grid barrier over ``programs`` programs (an empty step loop)."""
    count = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run() -> None:
        count.zero_()
        _barrier_probe[(programs,)](count, steps, SPIN_LOAD=spin_load, num_warps=4)

    return time_calls(run, repeats=5, warmup=2, device="cuda").median_ms * 1e3 / steps


def _measure(mode: str, cfg: Config, dtype_name: str, methods, reps: int) -> dict:
    """One row: median ms per method (None where it failed, with the error kept)."""
    dtype = DTYPES[dtype_name]
    row: dict = {"mode": mode, "config": cfg.name, "dtype": dtype_name, "ms": {}, "errors": {}}
    for name, make in _steps(mode, cfg, dtype, methods).items():
        try:
            step = make()
            row["ms"][name] = time_calls(step, repeats=reps, warmup=6, device="cuda").median_ms
        except Exception as exc:  # one failing method must not end the run
            row["ms"][name] = None
            row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            torch.cuda.synchronize()  # a broken context raises here and ends the run
    if "auto" in methods:
        from mirrorgrad.ops.rnn import dispatch

        row["auto"] = [{"picked": dispatch._AUTO_CHOICE.get(k), "ms": v}
                       for k, v in dispatch.AUTO_TIMES.items()]  # fmt: skip
    flops = step_flops(mode, cfg)
    peak = (dense_peak_tflops(torch.cuda.get_device_name()) or {}).get(dtype_name)
    best = row["ms"].get("persistent") or row["ms"].get("auto")  # what "ours" ran
    if best:
        row["tflops"] = flops / best / 1e9
        row["peak_share"] = row["tflops"] / peak if peak else None
    row["plan"] = _plan_row(mode, cfg, dtype)
    return row


def _plan_row(mode: str, cfg: Config, dtype: torch.dtype) -> dict | None:
    from mirrorgrad.ops.rnn import persistent_plan, persistent_probes

    layout = persistent_plan.plan(mode, cfg.batch, cfg.hidden, dtype, torch.device("cuda"))
    if layout is None:
        return None
    # The layout as planned, or streamed where the resident one did not fit the SM.
    ran = (layout, layout.streamed())
    compiled = {
        f"{kind}{'' if lay.resident else '-streamed'}": info
        for (kind, m, dt, lay), info in persistent_probes.COMPILED.items()
        if m == mode and dt == dtype and lay in ran
    }
    return {
        "programs": layout.programs,
        "groups": layout.groups,
        "bn": layout.bn,
        "resident": layout.resident,
        "w_bytes_per_program": layout.w_bytes(mode, dtype),
        "compiled": compiled,
        "barrier_us": {
            "spin_load": barrier_us(layout.programs, True),
            "spin_atomic": barrier_us(layout.programs, False),
        },
    }


def _profile(mode: str, cfg: Config, dtype_name: str, out: Path) -> None:
    """torch.profiler table of a few forward+backward steps of the persistent module."""
    from torch.profiler import ProfilerActivity, profile

    step = _steps(mode, cfg, DTYPES[dtype_name], ["persistent"])["persistent"]()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    (out / f"profile_{mode}_{cfg.name}_{dtype_name}.txt").write_text(table)
    print(table)


# ---- --phases: where a step's time goes (persistent_probes), old against new knobs ----

# The knobs of the variants ``--phases`` compares (PersistentTuning fields): "old" is
# the layout measured in windows 1-2; "new" the defaults since the 15:41 UTC window: the
# backward's hidden GEMM in independent MMA chains (resident: K slices over the warps; streamed: K
# chunks in slices, 256 deep, 8 warps), its other inputs in one round trip, and the
# barrier polled with acquiring atomics. (That window's first "new" did the same to the
# forward, which made it slower: docs/rnn-op.md.)
VARIANTS: dict[str, dict] = {
    "old": {"resident_split": 1, "bwd_resident_split": 1, "split_k": 1, "block_k": 64,
            "bwd_block_k": 64, "bwd_split_k": 1, "gather_loads": False, "num_warps": 4,
            "bwd_num_warps": 4, "resident_warps": (16, 8), "spin_load": True},
    "new": {"resident_split": 1, "bwd_resident_split": 8, "split_k": 1, "block_k": 64,
            "bwd_block_k": 256, "bwd_split_k": 8, "gather_loads": True, "num_warps": 4,
            "bwd_num_warps": 8, "resident_warps": (16, 8), "spin_load": False},
}  # fmt: skip
# Phases from the stamps (persistent_kernels.STAMPS; index of the stamp that ends each, -1: the
# next step's start): PROBE_LEVEL 2 has no "load" stamp, its "dot" runs from the start.
PHASES = {2: (("dot", 1, 3), ("gates", 3, 4), ("arrive", 4, 5), ("wait", 5, -1)),
          3: (("load", 1, 2), ("dot", 2, 3), ("gates", 3, 4), ("arrive", 4, 5),
              ("wait", 5, -1))}  # fmt: skip


def phase_split(stamps: Tensor, level: int) -> dict:
    """Median microseconds per phase over programs and steps (the first and last step
    left out: the backward's first has no hidden GEMM, the last no next start) from one
    launch's int64 [groups, programs, T, STAMPS]; "step" is start to next start, "work"
    start to arrival, "slowest" the median over steps of the slowest program's work."""
    s = stamps.double().flatten(0, 1)  # [programs, T, STAMPS]
    if s.shape[1] < 4 or not bool((s[..., 1] > 0).all()):
        return {"error": "too few steps or missing stamps"}
    ns, clk = s[..., 0], s[..., 1]
    ghz = ((clk[:, -1] - clk[:, 0]) / (ns[:, -1] - ns[:, 0])).median().item()
    nxt = torch.cat([clk[:, 1:], clk[:, -1:]], dim=1)

    def us(d: Tensor) -> float:
        return (d[:, 1:-1] / ghz / 1e3).median().item()

    out = {"ghz": ghz, "step": us(nxt - clk), "work": us(s[..., 5] - clk)}
    for name, a, b in PHASES[level]:
        out[name] = us((nxt if b == -1 else s[..., b]) - s[..., a])
    out["slowest"] = ((s[..., 5] - clk).max(0).values[1:-1] / ghz / 1e3).median().item()
    return out


def phases(mode: str, cfg: Config, dtype_name: str, level: int, reps: int) -> dict:
    """Layer-level step ms without and with the probe, and the per-phase split of the last
    forward and backward launch (``phase_split``)."""
    from mirrorgrad.ops.rnn import persistent_probes

    step = _steps(mode, cfg, DTYPES[dtype_name], ["layer-persistent"])["layer-persistent"]()
    plain = time_calls(step, repeats=reps, warmup=2, device="cuda").median_ms
    with persistent_probes.recording(level) as recorded:
        probed = time_calls(step, repeats=3, warmup=1, device="cuda").median_ms
        stamps = {kind: t.cpu() for kind, t in recorded.items()}
    split = {kind: phase_split(t, level) for kind, t in stamps.items()}
    return {"layer_ms": plain, "probed_ms": probed, "phases": split}


def _compare(cases: list[tuple[str, str, int]], level: int, reps: int, out: Path,
             time_limit: float) -> list[dict]:  # fmt: skip
    """Per case and VARIANTS entry: the module's ms (graphed cuDNN beside it, once per
    case) and ``phases``; rows written to phases.json as they come (a crash keeps them);
    no case starts after ``time_limit`` seconds."""
    rows, start = [], time.monotonic()
    for mode, dtype_name, i in cases:
        if time.monotonic() - start > time_limit:
            print(f"time limit: skipped {mode}:{dtype_name}:{i}", flush=True)
            continue
        cfg = CONFIGS[i]
        graphed = _measure(mode, cfg, dtype_name, ["cudnn-graph"], reps)["ms"]["cudnn-graph"]
        for name, knobs in VARIANTS.items():
            row = {"mode": mode, "config": cfg.name, "dtype": dtype_name, "variant": name,
                   "cudnn_graph_ms": graphed}  # fmt: skip
            try:
                with tuned(knobs_applied(knobs)):
                    module = _measure(mode, cfg, dtype_name, ["persistent"], reps)
                    row.update(module_ms=module["ms"], errors=module["errors"],
                               plan=module["plan"])  # fmt: skip
                    row.update(phases(mode, cfg, dtype_name, level, reps))
            except Exception as exc:  # one failing variant must not end the run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                torch.cuda.synchronize()
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "phases.json").write_text(json.dumps(rows, indent=1))
    return rows


def _phase_table(rows: list[dict]) -> str:
    names = ("load", "dot", "gates", "arrive", "wait")
    head = ["config", "dtype", "variant", "module ms", "vs graphed", "layer ms", "probed ms",
            "kind", "step us", *names, "slowest work"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = (r.get("module_ms") or {}).get("persistent")
        g = r.get("cudnn_graph_ms")
        for kind, p in (r.get("phases") or {"-": {}}).items():
            cells = [r["config"], r["dtype"], r["variant"], _num(ms), f"{g / ms:.2f}x" if ms and g
                     else "-", _num(r.get("layer_ms")), _num(r.get("probed_ms")), kind,
                     _num(p.get("step"), 1), *(_num(p.get(n), 1) for n in names),
                     _num(p.get("slowest"), 1)]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(x: float | None, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else "-"


# PersistentTuning's knobs per variant that ``--sweep`` times (the rest as planned).
# 128-deep backward chunks in 8 slices: the backward's K (G*H) is the longest MMA chain.
_BWD = {"bwd_block_k": 128, "bwd_split_k": 8}
SWEEP = (
    {},
    {"bwd_block_k": 128, "bwd_split_k": 8},
    {"bwd_block_k": 256, "bwd_split_k": 8},
    {**_BWD, "split_k": 4},
    {**_BWD, "resident_bytes": 0},
    {**_BWD, "num_warps": 4},
    {**_BWD, "num_stages": 2},
    {**_BWD, "max_bb": 16},
    {**_BWD, "fuse_gates": False},
)


def _sweep(cases: list[tuple[str, str, int]], reps: int, out: Path) -> list[dict]:
    """layer-persistent under each SWEEP variant (the PersistentTuning ``plan`` reads), every
    case per variant; best_knobs.json is rewritten after each variant (a run cut short
    still leaves the best of the variants it finished)."""
    rows = []
    for variant in SWEEP:
        with tuned(knobs_applied(variant)):
            for mode, dtype_name, i in cases:
                row = _measure(mode, CONFIGS[i], dtype_name, ["layer-persistent"], reps)
                row["variant"] = variant
                rows.append(row)
                print(json.dumps(row), flush=True)
        (out / "best_knobs.json").write_text(json.dumps(best_variant(rows)))
    return rows


def _table(rows: list[dict], methods) -> str:
    """One line per row: ms per method; persistent's and auto's (the module users get)
    ratios to plain and graphed cuDNN; TFLOP/s; what auto timed and picked."""
    head = ["mode", "dtype", "config", *methods, "pers/cudnn", "pers/graph", "auto/cudnn",
            "auto/graph", "TFLOP/s", "peak", "auto picked (its ms)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = r["ms"]
        cells = [r["mode"], r["dtype"], r["config"]]
        cells += [f"{ms[m]:.2f}" if ms.get(m) else "-" for m in methods]
        for ours in ("persistent", "auto"):
            cells += [_ratio(ms.get(base), ms.get(ours)) for base in ("cudnn", "cudnn-graph")]
        cells += [f"{r['tflops']:.1f}" if r.get("tflops") else "-"]
        cells += [f"{r['peak_share']:.1%}" if r.get("peak_share") else "-"]
        cells += ["; ".join(f"{a['picked']} ({_ms_list(a['ms'])})" for a in r.get("auto", []))
                  or "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _geomeans(rows))


def _ratio(base: float | None, ours: float | None) -> str:
    return f"{base / ours:.2f}x" if base and ours else "-"


def geomean_speedups(rows: list[dict], ours: str, base: str) -> dict[tuple[str, str], float]:
    """(mode, dtype) -> geometric mean over the rows of base ms / ours ms (the issue's
    targets), over the rows that have both."""
    logs: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        a, b = r["ms"].get(ours), r["ms"].get(base)
        if a and b:
            logs.setdefault((r["mode"], r["dtype"]), []).append(math.log(b / a))
    return {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}


def _geomeans(rows: list[dict]) -> list[str]:
    lines = []
    for ours in ("auto", "persistent"):
        for base in ("cudnn", "cudnn-graph"):
            for (mode, dtype), g in geomean_speedups(rows, ours, base).items():
                n = sum(1 for r in rows if (r["mode"], r["dtype"]) == (mode, dtype))
                lines.append(f"geomean {mode} {dtype} {ours} vs {base}: {g:.2f}x ({n} rows)")
    return lines


def _ms_list(times: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.2f}" for name, ms in times.items())


def best_variant(rows: list[dict]) -> dict:
    """The SWEEP variant with the lowest geometric mean of layer-persistent ms over the
    sweep's rows (every config and dtype it ran)."""
    by_variant: dict[str, list[float]] = {}
    for r in rows:
        ms = r["ms"].get("layer-persistent")
        if ms:
            by_variant.setdefault(json.dumps(r["variant"], sort_keys=True), []).append(ms)
    if not by_variant:
        return {}
    complete = {k: v for k, v in by_variant.items() if len(v) == max(map(len, by_variant.values()))}
    best = min(complete, key=lambda k: sum(math.log(x) for x in complete[k]))
    return json.loads(best)


def knobs_applied(knobs: dict) -> PersistentTuning:
    """The active PersistentTuning with ``knobs`` changed (field names, as in SWEEP; JSON
    lists as tuples: the plans are cached by their tuning)."""
    fields = {f.name for f in dataclasses.fields(PersistentTuning)}
    unknown = sorted(set(knobs) - fields)
    if unknown:
        raise ValueError(f"PersistentTuning has no knob {unknown}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in knobs.items()}
    return dataclasses.replace(active(PersistentTuning), **values)


def _sweep_table(rows: list[dict]) -> str:
    head = "| mode | dtype | config | variant | ms | compiled (regs/spills/smem) |"
    lines = [head, "|---" * 6 + "|"]
    for r in rows:
        ms = r["ms"].get("layer-persistent")
        compiled = ((r.get("plan") or {}).get("compiled")) or {}
        kernels = ", ".join(
            f"{k} {i['n_regs']}/{i['n_spills']}/{i['shared']}" for k, i in compiled.items()
        )
        variant = " ".join(f"{k}={v}" for k, v in r["variant"].items())
        cells = [r["mode"], r["dtype"], r["config"], variant, f"{ms:.3f}" if ms else "-", kernels]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _warm_case(case: tuple[str, str, int]) -> tuple[str, float, str | None]:
    """A ``--precompile-jobs`` worker: one forward+backward of the case's modules with
    impl fixed (triton, persistent), which compiles the Triton kernels that ``auto``
    will time into the shared on-disk cache. Returns (case, seconds, error)."""
    mode, dtype_name, i = case
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as main
    start, error = time.monotonic(), None
    try:
        for make in _steps(mode, CONFIGS[i], DTYPES[dtype_name], ["triton", "persistent"]).values():
            make()()
        torch.cuda.synchronize()
    except Exception as exc:  # the timed run reports it again
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    return f"{mode}:{dtype_name}:{i}", time.monotonic() - start, error


def precompile(cases: list[tuple[str, str, int]], jobs: int) -> dict:
    """Compile every case's kernels in ``jobs`` processes at once (Triton compiles one
    kernel at a time per process, most of a row's time when cold); the timed run then
    loads them from Triton's cache. Returns case -> (seconds, error)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return {case: (sec, err) for case, sec, err in pool.imap_unordered(_warm_case, cases)}


def _cases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(mode, dtype, config index) to run: ``--cases``, else dtypes x modes x configs."""
    if args.cases:
        return [(m, d, int(c)) for m, d, c in (case.split(":") for case in args.cases.split(","))]
    return [(mode, dtype, int(c)) for dtype in args.dtypes.split(",")
            for mode in args.modes.split(",") for c in args.configs.split(",")]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--modes", default="lstm,gru")
    parser.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time the SWEEP layouts instead")
    parser.add_argument("--knobs", type=Path, help="JSON of PersistentTuning knobs to set first")
    parser.add_argument("--cases", help="mode:dtype:config,... (instead of the cross product)")
    parser.add_argument("--phases", action="store_true",
                        help="per-phase us of each step, VARIANTS old against new")
    parser.add_argument("--probe-level", type=int, default=2, choices=(2, 3))
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="start no case after this many seconds (precompiling included)")
    parser.add_argument("--precompile-jobs", type=int, default=0,
                        help="compile the cases' kernels in this many processes first")
    return parser


def _run_cases(args: argparse.Namespace, methods: list[str], doc: dict) -> list[dict]:
    """The timed rows, each written to persistent_rnn.json as it comes (a run killed by
    an outer timeout keeps them); no case starts after ``--time-limit`` seconds."""
    start = time.monotonic()
    if args.precompile_jobs:
        warm = precompile(_cases(args), args.precompile_jobs)
        doc["precompile"] = warm
        print(f"precompiled in {time.monotonic() - start:.0f} s:", json.dumps(warm), flush=True)
    rows = doc.setdefault("rows", [])
    for mode, dtype_name, i in _cases(args):
        if time.monotonic() - start > args.time_limit:
            print(f"time limit: skipped {mode}:{dtype_name}:{i}", flush=True)
            continue
        rows.append(_measure(mode, CONFIGS[i], dtype_name, methods, args.reps))
        print(json.dumps(rows[-1]), flush=True)
        (args.out / "persistent_rnn.json").write_text(json.dumps(doc, indent=1))
        if args.profile:
            _profile(mode, CONFIGS[i], dtype_name, args.out)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("persistent_rnn: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    knobs = {}
    if args.knobs is not None and args.knobs.exists():
        knobs = json.loads(args.knobs.read_text())
    with tuned(knobs_applied(knobs)):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    methods = [m for m in args.methods.split(",") if m]
    if args.phases:
        rows = _compare(_cases(args), args.probe_level, args.reps, args.out, args.time_limit)
        print(_phase_table(rows))
        return 0
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "cudnn": torch.backends.cudnn.version()}  # fmt: skip
    doc: dict = {"env": env}
    if args.sweep:
        rows = doc["rows"] = _sweep(_cases(args), args.reps, args.out)
        doc["best"] = best_variant(rows) if rows else {}
        print("best variant:", json.dumps(doc["best"]))
    else:
        rows = _run_cases(args, methods, doc)
    (args.out / "persistent_rnn.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(env))
    print(_sweep_table(rows) if args.sweep else _table(rows, methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
