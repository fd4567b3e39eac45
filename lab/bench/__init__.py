"""The lab's benchmarks: ``python -m lab.bench SUBCOMMAND [options]`` from a clone's root.

The investigations behind docs/benchmarks.md, docs/reliability.md and the cost model:
they run as ``python -m hsgd.bench``'s subcommands do (the same harness, options,
tables, ``--json`` and ``--progress``: :mod:`hsgd.bench`), and most also across hosts
emulated on this machine (``--hosts N``, root only: :mod:`lab.hosts`)::

    python -m lab.bench --help                      # the subcommands
    python -m lab.bench io --gib 0.05 --repeats 1 --json io.json
    python -m lab.bench allreduce --hosts 2 --ranks-per-host 2 --link 1gbit   # as root

What each measures and how: docs/benchmark-methods.md.
"""

__all__ = ["SUBCOMMANDS"]

# A subcommand module is as hsgd.bench's (see hsgd/bench/__init__.py); one that runs on every
# rank launches python -m lab.bench through lab.bench._launch. Adding a subcommand is one module
# and one line here.
#: The subcommands, in ``--help`` order; each is the module ``lab.bench.<name>``.
SUBCOMMANDS = (
    "allreduce",
    "io",
    "box",
    "stall",
    "modes",
    "gossip",
    "lars",
    "diloco",
    "faults",
    "saves",
    "restart",
    "model",
    "train",
    "staging",
    "race",
)
