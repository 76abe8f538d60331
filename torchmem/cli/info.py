"""`python -m torchmem info`: what torchmem was built against and what it sees."""

import json

from torchmem import build_info

HELP = "print build information (torch and CUDA versions, compiled backends) as JSON"


def add_arguments(parser):
    del parser  # no options


def run(args):
    print(json.dumps(build_info(), indent=2, sort_keys=True))
    return 0
