"""`python -m torchmem stats`: placeholder until its owner lands it."""

HELP = "stats (not yet available)"


def add_arguments(parser):
    del parser


def run(args):
    raise ValueError("'stats' is not available yet")
