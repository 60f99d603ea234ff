"""How a plan differs between the copies of a repeated block: which ops each block
recomputes and saves, and how many distinct recomputed regions the backward holds (a
proxy for the distinct kernels Inductor compiles for it; planning only, no GPU needed).

    python benchmarks/block_plans.py [--workloads gpt2 transformer] [--mode balance]

The joint graph is captured on this machine as a GPU lays it out (``bench.frontier``'s
``--gpu-layout``) and planned with an H200's rates, as ``mirrorgrad.compile`` plans it
there. A node's place in its block is its op and how many of that op came before it in
the block (``add#3``: the block's third add); nodes outside the blocks keep their
names. A recomputed region is a connected set of recomputed nodes; two regions are
alike when they hold the same places, relative to their first block, and read the same
places (parameters by shape).
"""

from __future__ import annotations

import argparse
import re
import warnings
from collections import Counter, defaultdict

from torch.fx import Node

from mirrorgrad import _compat
from mirrorgrad.bench.frontier import capture_joint
from mirrorgrad.bench.suites import get_workload
from mirrorgrad.graph import fusion
from mirrorgrad.graph.cost import H200
from mirrorgrad.graph.joint import JointGraph
from mirrorgrad.mirror import Plan, PlanOptions, plan
from mirrorgrad.mirror.policy import op_name

# A repeated block's index in a module path: transformers' GPT-2 ``h.3``, the suite's
# ``blocks.3``.
BLOCK = re.compile(r"\.(?:blocks|h|layers)\.(\d+)")


def places(joint: JointGraph) -> dict[Node, tuple[int | None, str]]:
    """Per node: (its block or None, its place in the block or its name)."""
    seen: Counter = Counter()
    place = {}
    for n in joint.gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        paths = [str(path) for path, *_ in stack.values()]
        found = [m for m in map(BLOCK.search, reversed(paths)) if m]
        if n not in joint.forward_set or not found:
            place[n] = (None, n.name)
            continue
        block, op = int(found[0].group(1)), op_name(n).split("::")[-1]
        seen[block, op] += 1
        place[n] = (block, f"{op}#{seen[block, op]}")
    return place


def regions(p: Plan, place: dict) -> Counter:
    """Distinct recomputed regions of ``p``, with how many times each occurs."""
    recomputed = set(p.mirrored)
    parent = {n: n for n in recomputed}

    def root(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in recomputed:
        for a in n.all_input_nodes:
            if a in recomputed:
                parent[root(a)] = root(n)
    members = defaultdict(list)
    for n in recomputed:
        members[root(n)].append(n)
    found: Counter = Counter()
    for nodes in members.values():
        first = min((place[n][0] for n in nodes if place[n][0] is not None), default=0)

        def relative(n: Node, first: int = first) -> str:
            if n.op == "placeholder":
                return f"param{tuple(n.meta['val'].shape)}"
            block, name = place[n]
            return name if block is None else f"{block - first}:{name}"

        reads = {a for n in nodes for a in n.all_input_nodes if a not in recomputed}
        found[tuple(sorted(map(relative, nodes))), tuple(sorted(map(relative, reads)))] += 1
    return found


def report(name: str, joint: JointGraph, p: Plan) -> None:
    place = places(joint)
    blocks = {b for b, _ in place.values() if b is not None}
    print(
        f"{name}: {len(blocks)} blocks; balance peak {p.peak_after / 2**20:,.0f} MiB "
        f"({p.peak_after / p.peak_before:.3f}x of no mirroring), "
        f"+{p.added_time_s / p.step_time_s:.2%} estimated"
    )
    for what, nodes in (("recomputed", p.mirrored), ("saved", p.saved)):
        by_place = defaultdict(set)
        for n in nodes:
            block, where = place[n]
            if block is not None:
                by_place[where].add(block)
        every = sorted(w for w, b in by_place.items() if b == blocks)
        print(f"  {what} in every block: {' '.join(every)}")
        for where, b in sorted(by_place.items()):
            if b != blocks:
                print(f"  {what} in blocks {sorted(b)} only: {where}")
    found = regions(p, place)
    print(f"  recomputed regions: {sum(found.values())}, distinct {len(found)}")
    for (nodes, _), count in found.most_common():
        print(f"    x{count}: {' '.join(nodes)[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/block_plans.py")
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "transformer"])
    parser.add_argument("--mode", default="balance", choices=["balance", "off"])
    args = parser.parse_args()
    for name in args.workloads:
        built = get_workload(name).build(device="cpu", quick=False)
        gpu_layout = _compat.gpu_shape_padding(), fusion.strides_as_on_a_gpu()
        with gpu_layout[0], gpu_layout[1], warnings.catch_warnings():
            warnings.simplefilter("ignore")
            joint = capture_joint(built.model, *built.make_batch())
            p = plan(joint, PlanOptions(mode=args.mode, device=H200))
        report(name, joint, p)


if __name__ == "__main__":
    main()
