"""The `python -m torchmem` command line: one module per subcommand.

Each subcommand module defines HELP (one line), add_arguments(parser) and
run(args) -> int (the exit status). Modules are imported only when their
subcommand runs, so `--help` is fast and optional dependencies load late.
"""

import argparse
import importlib
import sys

COMMANDS = {
    "demo": "torchmem.cli.demo",
    "replay": "torchmem.cli.replay",
    "stats": "torchmem.cli.stats",
    "plot": "torchmem.cli.plot",
    "convert": "torchmem.cli.convert",
    "info": "torchmem.cli.info",
    "top": "torchmem.cli.top",
    "exporter": "torchmem.cli.exporter",
}


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m torchmem",
        description="torchmem: a fragmentation-aware GPU memory manager for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"torchmem {args.command}: error: {exc}", file=sys.stderr)
        return 2
