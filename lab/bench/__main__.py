"""``python -m lab.bench SUBCOMMAND [options]``: run one of the lab's benchmarks, print its tables.

Parsed and run by :func:`hsgd.bench.__main__.main`, with the lab's subcommands
(:data:`lab.bench.SUBCOMMANDS`); under ``mpiexec`` every rank runs the
subcommand's ``worker(args)``, as in the package.
"""

import sys
from typing import Optional, Sequence

from hsgd.bench.__main__ import main as _main

from . import SUBCOMMANDS

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    return _main(argv, package=__package__ or "lab.bench", subcommands=SUBCOMMANDS,
                 description="The lab's benchmarks of hsgd")


if __name__ == "__main__":
    sys.exit(main())
