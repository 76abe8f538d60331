"""`python -m torchmem replay`: placeholder until its owner lands it."""

HELP = "replay (not yet available)"


def add_arguments(parser):
    del parser


def run(args):
    raise ValueError("'replay' is not available yet")
