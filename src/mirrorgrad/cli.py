"""`mirrorgrad train | bench | explain`, `--version`: each subcommand lives with its package."""

from __future__ import annotations

import argparse
import importlib
import sys

from mirrorgrad import __version__

# subcommand -> module that defines add_arguments(parser) and run(args) -> int
_COMMANDS = {
    "train": ("mirrorgrad.train.command", "Train a model (see `mirrorgrad train lm --help`)."),
    "bench": ("mirrorgrad.bench.command", "Benchmark workloads x methods; tables and plots."),
    "explain": ("mirrorgrad.bench.explain", "Print the mirror plan of a named workload."),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mirrorgrad", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mirrorgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue
        module.add_arguments(p)
        modules[name] = module
    args = parser.parse_args(argv)
    if args.command not in modules:
        parser.error(f"`{args.command}` is not available in this build")
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
