"""`mirrorgrad explain WORKLOAD`: print the mirror plan of a named benchmark workload."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mirrorgrad.bench.runner import DTYPES, check_device, default_device
from mirrorgrad.bench.suites import WORKLOADS, get_workload
from mirrorgrad.options import MirrorOptions


def parse_mode(text: str) -> dict[str, Any]:
    """``--mode``: ``MirrorOptions.from_cli`` as an argparse type, as the keywords
    ``mode`` and ``budget`` (``--max-overhead`` sets the cap apart)."""
    try:
        options = MirrorOptions.from_cli(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return {"mode": options.mode} | ({} if options.budget is None else {"budget": options.budget})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", choices=list(WORKLOADS), metavar="WORKLOAD",
                        help="`mirrorgrad bench --list`")
    parser.add_argument("--mode", type=parse_mode, default={"mode": "balance"},
                        help="balance (default), off, or budget:FRACTION|BYTES")
    parser.add_argument("--max-overhead", type=float, help="balance mode's time cap (fraction)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--mgnn", action="store_true",
                        help="swap the model's torch.nn RNNs for mirrorgrad.nn's first (the plan "
                        "then chooses each RNN op's memory mode: its 'op memory' lines)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, on the CPU")
    parser.add_argument("--batch", type=int, help="default: the workload's batch")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", help="default: cuda if available (cpu with --quick)")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's keywords; a ValueError naming the option, before any work."""
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.device is not None:
        check_device(args.device)
    options = dict(args.mode)
    if args.max_overhead is not None:
        options["max_overhead"] = args.max_overhead
        try:
            MirrorOptions(**options)
        except ValueError as e:  # "max_overhead=nan: a finite fraction ..."
            reason = str(e).partition(": ")[2]
            raise ValueError(f"--max-overhead {args.max_overhead}: {reason}") from None
    missing = WORKLOADS[args.workload].missing_packages()
    if missing:
        raise ValueError(
            f"{args.workload} needs {', '.join(missing)}, not installed here: "
            f"pip install {' '.join(missing)}"
        )
    return options


def run(args: argparse.Namespace) -> int:
    """Exit status 0, or 2 with one line for bad input (before any work)."""
    import mirrorgrad

    try:
        options = _options(args)
    except ValueError as e:
        print(f"mirrorgrad explain: error: {e}", file=sys.stderr)
        return 2
    workload = get_workload(args.workload)
    device = args.device or default_device(args.quick)
    built = workload.build(
        batch=args.batch, dtype=DTYPES[args.dtype], device=device, quick=args.quick
    )
    if args.mgnn:
        import mirrorgrad.nn

        built.model = mirrorgrad.nn.convert(built.model)
    # Graph breaks (torch.nn RNNs are not traced) give one plan per graph: the
    # largest is shown.
    plan = mirrorgrad.explain(built.model, *built.make_batch(), fullgraph=False, **options)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        rnns = ", mirrorgrad.nn RNNs" if args.mgnn else ""
        print(f"{workload.name}: {workload.description}; batch {built.batch}, {args.dtype}{rnns}")
        print(plan)
    return 0
