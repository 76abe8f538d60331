"""Entry point of `python -m torchmem` (see torchmem/cli/)."""

import sys

from torchmem.cli import main

if __name__ == "__main__":
    sys.exit(main())
