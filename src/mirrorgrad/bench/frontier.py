"""Our plans against PyTorch's min-cut (``activation_memory_budget``) on a workload's
full-size joint graph, judged by the same liveness and cost models; and planning time.

The joint graph is the one Inductor hands its partitioner (``torch.compile`` with our
capturing ``custom_partitioner_fn``) and nothing is executed: the capture stops in the
partitioner, so full-size graphs cost a trace on any device.

    python -m mirrorgrad.bench.frontier --out DIR [--workloads gpt2 transformer resnet152] \
        [--gpu-layout]

Per workload: min-cut at each fraction, our budget at the same fraction, our budget
asked for min-cut's estimated peak in bytes (the frontier comparison: same peak, whose
recomputation costs less), and balance, with whether it reaches its target (0.8x
min-cut's peak within its time cap) and why not; estimated peak (MiB and against
min-cut's default partition), estimated added time (against the estimated step),
planning seconds. Writes ``frontier.json`` to ``--out``; the table is printed last, then
balance's reasons.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mirrorgrad import _compat
from mirrorgrad.graph import fusion, liveness
from mirrorgrad.graph.cost import H100, StepCost, rates_for
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.mirror import Plan, PlanOptions, plan
from mirrorgrad.mirror.min_cut import min_cut_partition, min_cut_peak, partition_peak
from mirrorgrad.mirror.partition import remove_detaches
from mirrorgrad.mirror.policy import is_random, op_name

FRACTIONS = (0.5, 0.3)


class _Captured(Exception):
    """Raised from the partitioner once the joint graph is in hand: nothing runs."""

    def __init__(self, joint: JointGraph) -> None:
        super().__init__("joint graph captured")
        self.joint = joint


class _CapturePartitioner(_compat.CustomPartitionerFn):
    """Inductor's partitioner hook that keeps the joint graph and stops the compile."""

    def __call__(self, gm, joint_inputs, *, num_fwd_outputs, **kwargs):
        remove_detaches(gm)
        raise _Captured(JointGraph.from_fx(gm, num_fwd_outputs))

    def uuid(self) -> bytes:
        return os.urandom(16)  # never a cache hit: the partitioner must run


def capture_joint(model: torch.nn.Module, *batch: torch.Tensor) -> JointGraph:
    """The joint graph Inductor hands its partitioner for ``model(*batch)``: after its
    decompositions and joint-graph passes (dropout's ``rand`` is then a seeded
    ``inductor_random``), before any code generation."""
    torch._dynamo.reset()
    patch = {_compat.INDUCTOR_PARTITIONER_CONFIG: _CapturePartitioner()}
    try:
        with _compat.inductor_config.patch(patch):
            torch.compile(model, fullgraph=True)(*batch)
    except Exception as e:  # Dynamo wraps what the partitioner raises
        cause = e
        while cause is not None and not isinstance(cause, _Captured):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return cause.joint
    finally:
        torch._dynamo.reset()
    raise RuntimeError("the model compiled without a backward graph")


def compare(joint: JointGraph, fractions: tuple[float, ...] = FRACTIONS) -> list[dict[str, Any]]:
    """One row per plan: min-cut's and ours, by the same models."""
    # A CPU capture stands for the GPU graph: an H100's rates, kernel launches included.
    rates = rates_for(joint.device) if joint.device.type == "cuda" else H100
    cost = StepCost(joint, rates, fusion=True)
    index = liveness.GraphIndex(joint)
    base_peak = min_cut_peak(joint, fusion=True, index=index)
    rows: list[dict[str, Any]] = []

    def row(name: str, peak: int, added_s: float, seconds: float | None) -> dict[str, Any]:
        rows.append(
            {
                "plan": name,
                "peak_mib": peak / 2**20,
                "peak_vs_compile": peak / base_peak,
                "added_time": added_s / cost.step_seconds,
                "planning_s": seconds,
            }
        )
        return rows[-1]

    row("compile (min-cut)", base_peak, 0.0, None)

    def ours(name: str, options: PlanOptions) -> Plan:
        start = time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unmet budget is in the table
            p = plan(joint, options)
        row(name, p.peak_after, p.added_time_s, time.process_time() - start)
        return p

    # Balance's target is a share of min-cut's peak, as the table's ratios are.
    balanced = ours("mirror-balance", PlanOptions(mode="balance", device=rates,
                                                  reference_peak=base_peak,
                                                  diagnose_balance=True))  # fmt: skip
    rows[-1]["balance_target"] = balanced.balance_target.to_dict()
    for f in fractions:
        start = time.process_time()
        saved, recomputed = min_cut_partition(joint, f)
        their = partition_peak(joint, saved, recomputed, fusion=True, index=index)
        seconds = sum(cost.recomputed(n).seconds for n in recomputed)
        # min-cut bans native_dropout, rand_like and randn_like from recomputation, not
        # every op that may draw (an attention kernel with a dropout argument, a `rand`).
        drawn = sorted({op_name(n).split("::")[-1] for n in recomputed if is_random(n)})
        note = f" (recomputes {', '.join(drawn)}: may draw)" if drawn else ""
        row(f"compile-budget-{f} (min-cut){note}", their, seconds, time.process_time() - start)
        ours(f"mirror-budget-{f}", PlanOptions(mode="budget", budget=f, device=rates))
        ours(
            f"mirror at min-cut {f}'s peak", PlanOptions(mode="budget", budget=their, device=rates)
        )
    return rows


@contextlib.contextmanager
def _as_on_a_gpu() -> Iterator[None]:
    with _compat.gpu_shape_padding(), fusion.strides_as_on_a_gpu():
        yield


def _table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| workload | nodes | plan | est. peak MiB | / compile | est. added time | planning s |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | | {r['error']} | | | | |")
            continue
        for i, row in enumerate(r["rows"]):
            s = row["planning_s"]
            target = row.get("balance_target")
            plan_cell = f"{row['plan']}: {target['verdict']}" if target else row["plan"]
            lines.append(
                f"| {name if i == 0 else ''} | {r['nodes'] if i == 0 else ''} | {plan_cell} "
                f"| {row['peak_mib']:,.0f} | {row['peak_vs_compile']:.3f}x "
                f"| +{row['added_time']:.1%} | {'' if s is None else f'{s:.2f}'} |"
            )
    reasons = [
        f"- {name}, balance: {row['balance_target']['reason']}"
        for name, r in results.items()
        for row in r.get("rows", [])
        if row.get("balance_target")
    ]
    return "\n".join([*lines, "", *reasons] if reasons else lines)


def main(argv: list[str] | None = None) -> int:
    from mirrorgrad.bench.suites import get_workload

    parser = argparse.ArgumentParser(prog="python -m mirrorgrad.bench.frontier")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", nargs="+", default=["transformer", "gpt2", "resnet50"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--gpu-layout", action="store_true",
                        help="on the CPU, capture and lay out as a GPU does (Inductor's pad_mm "
                        "padding of unaligned matmul dimensions, padded strides): estimates of "
                        "unaligned vocabularies (GPT-2's 50,257) then follow the GPU's")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    env = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    for name in args.workloads:
        try:
            built = get_workload(name).build(device=args.device, quick=args.quick)
            layout = _as_on_a_gpu() if args.gpu_layout else contextlib.nullcontext()
            with layout:
                start = time.perf_counter()
                joint = capture_joint(built.model, *built.make_batch())
                capture_s = time.perf_counter() - start
                rows = compare(joint)
            results[name] = {"nodes": len(joint.gm.graph.nodes), "capture_s": capture_s}
            results[name]["rows"] = rows
        except Exception as e:  # one workload's failure is a row, not the end of the run
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"{name}: {json.dumps(results[name])[:300]}", file=sys.stderr, flush=True)
        # after every workload: a run killed by an outer timeout keeps what it measured
        (args.out / "frontier.json").write_text(
            json.dumps({"env": env, "results": results}, indent=1)
        )
    print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
