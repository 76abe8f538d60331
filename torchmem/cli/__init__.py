"""The `python -m torchmem` command line: one module per subcommand.

Each subcommand module defines HELP (one line), add_arguments(parser) and
run(args) -> int (the exit status). Modules are imported only when their
subcommand runs, so `--help` is fast and optional dependencies load late.

Every problem the user can fix is one line on stderr and exit status 2: a bad
option prints its subcommand's usage (not the top level's), and a module built
for another torch, or a clone folder shadowing the package, says what to do
instead of a traceback. Shared option rules live in torchmem/cli/options.py.
"""

import argparse
import difflib
import importlib
import os
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
        command.set_defaults(_module=module, _parser=command)
    return parser


def shadowing_folder():
    """The folder `torchmem` resolves to when it is a directory without __init__.py (a clone
    of the repository, named torchmem, in the current directory) instead of the package; else None.

    From the folder above a clone, Python takes the clone for a namespace package named
    torchmem, ahead of the installed package, so nothing of torchmem's top level exists."""
    package = sys.modules.get("torchmem")
    if package is None or getattr(package, "__file__", None) is not None:
        return None
    return next(iter(getattr(package, "__path__", [])), "?")


def _unknown_options(parser, extras):
    """argparse's error for options the subcommand does not take, with a close match if any."""
    known = [option for action in parser._actions for option in action.option_strings]
    unknown = [word for word in extras if word.startswith("-")] or extras
    hints = []
    for word in unknown:
        close = difflib.get_close_matches(word.split("=")[0], known, n=1)
        if close:
            hints.append(f"{word}: did you mean {close[0]}?")
    parser.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def _one_line(exc):
    return " ".join(str(exc).split())


def main(argv=None):
    folder = shadowing_folder()
    if folder is not None:
        print(f"torchmem: error: `torchmem` here is the folder {folder} (a clone of the repository, found first "
              f"because it sits in the current directory {os.getcwd()}), not the torchmem package. Run from "
              f"inside the clone (cd {os.path.basename(folder)}) or from any other folder; if torchmem is not "
              f"installed yet, install it from the clone (make build).", file=sys.stderr)
        return 2
    # after the shadowing check: in a clone's folder these modules do not exist
    from torchmem._loader import ExtensionLoadError
    from torchmem.cli.options import CliError

    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_options(args._parser, extras)
    try:
        return int(args._module.run(args) or 0)
    except (CliError, ValueError, FileNotFoundError, ExtensionLoadError) as exc:
        print(f"torchmem {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
