"""`python -m torchmem convert`: placeholder until its owner lands it."""

HELP = "convert (not yet available)"


def add_arguments(parser):
    del parser


def run(args):
    raise ValueError("'convert' is not available yet")
