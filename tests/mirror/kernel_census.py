"""The kernels Inductor generates for GPT-2 under torch.compile and under
mirrorgrad.compile(mode="balance"), forward and backward apart (a GPU diagnostic: run by
hand, not collected by pytest).

    python tests/mirror/kernel_census.py [--json OUT.json]
    python tests/mirror/kernel_census.py --device cpu --quick   # C++ kernels, seconds

One process, the two compiles one after the other (Dynamo reset between them, Inductor's
FX graph and AOTAutograd caches off), each followed by one forward+backward of the
workload of tests/mirror/cold_compile.py. Per method and graph: the kernels defined in
the generated code, by kind (Triton's ``pointwise``, ``reduction``,
``persistent_reduction``, ``template``, ...; ``cpp`` on a CPU) and by fused name (the
original ATen ops Inductor names a kernel after, e.g. ``fused_add_native_layer_norm``),
with counts; ``distinct`` counts kernel sources, what cold_compile.py's ``kernels``
counts in cubins. Last, the kernels only one method has (by kind and fused name, counts
compared), with the size hints of mirrorgrad's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

METHODS = ("torch.compile", "balance")
# Triton kernel names: triton_<first 3 letters of the kind>_<fused name>_<index>.
KINDS = {
    "poi": "pointwise",
    "red": "reduction",
    "per": "persistent_reduction",
    "tem": "template",
    "for": "foreach",
    "spl": "split_scan",
}
# A kernel defined in Inductor's generated wrapper: `name = async_compile.triton('name', '''`
# (or `.cpp_pybinding([...], '''` on a CPU).
DEFINITION = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.MULTILINE)
SIZE_HINTS = re.compile(r"size_hints=(\{[^}]*\}|\[[^\]]*\])")
# Ops that only move or re-describe bytes: a kernel of these alone is a layout copy.
LAYOUT_OPS = frozenset({
    "_to_copy", "_unsafe_view", "as_strided", "clone", "contiguous", "copy", "expand",
    "permute", "slice", "squeeze", "t", "transpose", "unsqueeze", "view",
})  # fmt: skip


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    kind: str
    fused: str  # the fused op names, or the name less its index
    digest: str  # of its source
    size_hints: str

    def ops(self, known: frozenset[str]) -> list[str]:
        """The ATen ops of the fused name (split at the longest known op names)."""
        rest = self.fused.removeprefix("fused_")
        found = []
        while rest:
            match = max(
                (op for op in known if rest == op or rest.startswith(op + "_")),
                key=len,
                default=rest.split("_", 1)[0] or rest,
            )
            found.append(match)
            rest = rest[len(match) + 1 :]
        return found


def aten_op_names() -> frozenset[str]:
    import torch

    return frozenset(name for name in dir(torch.ops.aten) if not name.startswith("__"))


@dataclass(slots=True)
class Census:
    forward: list[Kernel] = field(default_factory=list)
    backward: list[Kernel] = field(default_factory=list)

    def graphs(self) -> dict[str, list[Kernel]]:
        return {"forward": self.forward, "backward": self.backward}


def kernels_of(source: str) -> list[Kernel]:
    """The kernels a generated wrapper defines."""
    starts = list(DEFINITION.finditer(source))
    found = []
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(source)
        body = source[match.end() : end]
        name = match.group(1)
        parts = name.split("_")
        if parts[0] == "triton" and len(parts) > 2:
            kind = KINDS.get(parts[1], parts[1])
            fused = "_".join(parts[2:-1])
        else:  # cpp_fused_..._0 on a CPU
            kind = parts[0]
            fused = "_".join(parts[1:-1])
        hints = SIZE_HINTS.search(body)
        found.append(
            Kernel(
                name=name,
                kind=kind,
                fused=fused,
                digest=hashlib.sha256(body.encode()).hexdigest()[:16],
                size_hints=hints.group(1) if hints else "",
            )
        )
    return found


def run(method: str, args: argparse.Namespace) -> tuple[Census, float]:
    import torch
    from torch._inductor.compile_fx import compile_fx

    import mirrorgrad
    from mirrorgrad import _compat
    from mirrorgrad.bench.workloads import WORKLOADS

    census = Census()
    inner = _compat.compile_fx_inner

    def compile_inner(gm, example_inputs, **kwargs):
        compiled = inner(gm, example_inputs, **kwargs)
        source = getattr(compiled, "source_code", None)
        if source is None:
            sys.exit(f"{type(compiled).__name__} has no source_code: this torch hides it")
        graph = census.backward if kwargs.get("is_backward") else census.forward
        graph.extend(kernels_of(source))
        return compiled

    _compat.compile_fx_inner = compile_inner  # mirrorgrad's inner compile goes through it
    try:
        torch._dynamo.reset()
        device = args.device
        if device.startswith("cuda"):
            torch.set_float32_matmul_precision("high")  # as mirrorgrad bench sets it
        torch.manual_seed(0)
        built = WORKLOADS["gpt2"].build(batch=args.batch, device=device, quick=args.quick)
        batch = built.make_batch()
        if args.length:
            batch = tuple(t[:, : args.length] for t in batch)
        start = time.perf_counter()
        if method == "torch.compile":
            step = torch.compile(
                built.model,
                backend=lambda gm, inputs: compile_fx(gm, inputs, inner_compile=compile_inner),
            )
        else:
            step = mirrorgrad.compile(built.model, mode="balance")
        step(*batch).backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return census, time.perf_counter() - start
    finally:
        _compat.compile_fx_inner = inner


def _table(title: str, rows: dict[str, tuple[int, ...]], header: tuple[str, ...]) -> None:
    print(f"\n{title}")
    width = max([len(k) for k in rows] + [20])
    print(f"  {'':{width}} " + " ".join(f"{h:>14}" for h in header))
    for key, values in rows.items():
        print(f"  {key:{width}} " + " ".join(f"{v:>14}" for v in values))


def report(censuses: dict[str, Census]) -> dict:
    ours, theirs = censuses["balance"], censuses["torch.compile"]
    header = tuple(f"{m} {g[:3]}" for m in METHODS for g in ("forward", "backward"))
    per_graph = [censuses[m].graphs()[g] for m in METHODS for g in ("forward", "backward")]
    kinds = sorted({k.kind for kernels in per_graph for k in kernels})
    rows = {kind: tuple(sum(k.kind == kind for k in ks) for ks in per_graph) for kind in kinds}
    rows["all"] = tuple(len(ks) for ks in per_graph)
    _table("kernels by kind", rows, header)
    distinct = {m: len({k.digest for k in c.forward + c.backward}) for m, c in censuses.items()}
    print("distinct kernel sources, forward and backward together: "
          + ", ".join(f"{m} {n}" for m, n in distinct.items()))  # fmt: skip
    known = aten_op_names()
    layout = tuple(
        sum(bool(k.ops(known)) and set(k.ops(known)) <= LAYOUT_OPS for k in ks) for ks in per_graph
    )
    _table("kernels of layout ops alone (copies)", {"layout copies": layout}, header)
    ops = sorted({op for ks in per_graph for k in ks for op in k.ops(known)})
    by_op = {op: tuple(sum(op in k.ops(known) for k in ks) for ks in per_graph) for op in ops}
    _table("kernels containing each op", by_op, header)
    only: dict[str, dict] = {}
    for graph in ("forward", "backward"):
        mine = Counter((k.kind, k.fused) for k in ours.graphs()[graph])
        other = Counter((k.kind, k.fused) for k in theirs.graphs()[graph])
        names = sorted(set(mine) | set(other), key=lambda n: (-mine[n] - other[n], n))
        counts = {f"{kind} {fused}": (other[(kind, fused)], mine[(kind, fused)])
                  for kind, fused in names}  # fmt: skip
        _table(f"{graph}: kernels by kind and fused name", counts, ("torch.compile", "balance"))
        extra = mine - other
        missing = other - mine
        hints = {(k.kind, k.fused): k.size_hints for k in ours.graphs()[graph]}
        print(f"\n{graph}: {sum(extra.values())} kernels only balance has "
              f"({sum(missing.values())} only torch.compile has)")  # fmt: skip
        for (kind, fused), n in sorted(extra.items(), key=lambda item: (-item[1], item[0])):
            print(f"  +{n} {kind} {fused}  {hints[(kind, fused)]}")
        for (kind, fused), n in sorted(missing.items(), key=lambda item: (-item[1], item[0])):
            print(f"  -{n} {kind} {fused}")
        only[graph] = {
            "balance": {f"{k} {f}": n for (k, f), n in extra.items()},
            "torch.compile": {f"{k} {f}": n for (k, f), n in missing.items()},
        }
    return {
        "distinct": distinct,
        "kernels": {
            m: {g: [k.name for k in ks] for g, ks in censuses[m].graphs().items()} for m in METHODS
        },
        "only": only,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, help="the workload's batch unless given")
    parser.add_argument("--length", type=int, help="tokens: the first LENGTH of each sample")
    parser.add_argument("--quick", action="store_true", help="the workload's small size")
    parser.add_argument("--json", help="also write the kernel names and differences here")
    args = parser.parse_args()
    # Before torch is imported: every graph compiled, none read back from a cache.
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    censuses = {}
    for method in METHODS:
        censuses[method], seconds = run(method, args)
        print(f"{method}: compiled and ran one step in {seconds:.1f} s", flush=True)
    found = report(censuses)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
