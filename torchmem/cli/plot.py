"""`python -m torchmem plot`: placeholder until its owner lands it."""

HELP = "plot (not yet available)"


def add_arguments(parser):
    del parser


def run(args):
    raise ValueError("'plot' is not available yet")
