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
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        # Ctrl-C before a subcommand installs its own handler (imports, argument parsing).
        print("mirrorgrad: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mirrorgrad", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mirrorgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Only the chosen subcommand's module is imported: bench pulls in much more than train.
    chosen = next((a for a in argv if a in _COMMANDS), None)
    module = None
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
