"""What a plan recomputes and what the cost model charges for it, by op and by shape
(planning only, no GPU needed).

    python benchmarks/recompute_prices.py [--workloads resnet152] [--mode balance] [--rates H200]

The joint graph is captured on this machine as a GPU lays it out (``bench.frontier``'s
``--gpu-layout``) and planned at the named GPU's rates, as ``mirrorgrad.compile`` plans
it there. Per recomputed op: how many, whether Inductor computes it inside its readers'
kernels (``inlined``: no kernel of its own) or writes it (a kernel, priced at least one
launch), the price in total and how many sit at the launch floor, and the output shapes.
Per written shape: the price of one, the bytes its kernel moves and those bytes' time at
the rates' bandwidth, to hold against a profile's kernel times.
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter, defaultdict

from mirrorgrad import _compat
from mirrorgrad.bench.frontier import capture_joint
from mirrorgrad.bench.suites import get_workload
from mirrorgrad.graph import cost, fusion
from mirrorgrad.mirror import PlanOptions, plan
from mirrorgrad.mirror.policy import op_name


def shape_of(node) -> tuple:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if hasattr(v, "shape")), None)
    return tuple(val.shape) if hasattr(val, "shape") else ()


def report(name: str, joint, rates: cost.DeviceRates, mode: str) -> None:
    p = plan(joint, PlanOptions(mode=mode, device=rates))
    prices = cost.StepCost(joint, rates, fusion=True)
    print(
        f"{name} {mode}: peak {p.peak_after / 2**20:,.0f} MiB "
        f"({p.peak_after / p.peak_before:.3f}x of no mirroring); step "
        f"{p.step_time_s * 1e3:.2f} ms estimated, recomputation {p.added_time_s * 1e3:.3f} ms "
        f"(+{p.added_time_s / p.step_time_s:.2%})"
    )
    by_op: dict[tuple[str, bool], list] = defaultdict(list)
    written: dict[tuple, list] = defaultdict(list)
    for n in p.mirrored:
        price = prices.recomputed(n)
        inlined = n in prices.inlined
        floored = not inlined and price.seconds == rates.launch_s > 0
        by_op[op_name(n).split("::")[-1], inlined].append((price, floored, shape_of(n)))
        if not inlined and price.seconds > 0:
            written[op_name(n).split("::")[-1], shape_of(n)].append(price)
    print(
        "  op (inlined: no kernel of its own): count, price in total, at the launch floor, shapes"
    )
    for (op, inlined), rows in sorted(
        by_op.items(), key=lambda kv: -sum(r[0].seconds for r in kv[1])
    ):
        total = sum(r[0].seconds for r in rows)
        shapes = Counter(r[2] for r in rows).most_common(4)
        print(
            f"    {op:24s} {'inlined' if inlined else 'written':7s} x{len(rows):<4d} "
            f"{total * 1e3:7.3f} ms  floor x{sum(r[1] for r in rows):<3d} {shapes}"
        )
    print(
        "  written kernels by shape: price of one, bytes it moves, their time at "
        f"{rates.bytes_per_s / 1e12:.1f} TB/s"
    )
    for (op, shape), rows in sorted(written.items(), key=lambda kv: -len(kv[1])):
        each_s = sum(r.seconds for r in rows) / len(rows)
        each_b = sum(r.bytes for r in rows) / len(rows)
        print(
            f"    {op} {shape} x{len(rows)}: {each_s * 1e6:.1f} us, {each_b / 2**20:.1f} MiB, "
            f"{each_b / rates.bytes_per_s * 1e6:.1f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/recompute_prices.py")
    parser.add_argument("--workloads", nargs="+", default=["resnet152"])
    parser.add_argument("--mode", default="balance", choices=["balance", "budget"])
    parser.add_argument("--rates", default="H200", choices=["H100", "H200", "A100"])
    args = parser.parse_args()
    rates = getattr(cost, args.rates)
    for name in args.workloads:
        built = get_workload(name).build(device="cpu", quick=False)
        with _compat.gpu_shape_padding(), fusion.strides_as_on_a_gpu(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            joint = capture_joint(built.model, *built.make_batch())
            report(name, joint, rates, args.mode)


if __name__ == "__main__":
    main()
