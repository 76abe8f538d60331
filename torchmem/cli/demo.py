"""`python -m torchmem demo`: placeholder until its owner lands it."""

HELP = "demo (not yet available)"


def add_arguments(parser):
    del parser


def run(args):
    raise ValueError("'demo' is not available yet")
