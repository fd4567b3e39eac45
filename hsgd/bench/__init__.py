"""Benchmarks: ``python -m hsgd.bench SUBCOMMAND [options]``.

Every subcommand measures one thing, prints a markdown table (the form in
``docs/benchmarks.md`` and ``docs/reliability.md``), can write its raw
measurements and its settings as JSON (``--json PATH``), and reports its
progress on stderr (``--progress``). Those that time something take
``--repeats`` timed runs after ``--warmup`` untimed ones and show medians;
those that need several ranks launch ``mpiexec`` on themselves, one job per
rank count, so every command is run as a plain ``python``::

    python -m hsgd.bench --help                      # the subcommands
    python -m hsgd.bench allreduce --ranks 2 --sizes 1e6 --repeats 5
    python -m hsgd.bench io --gib 0.05 --repeats 1 --json io.json

Subcommands (one module each in this package, listed in :data:`SUBCOMMANDS`):

- ``allreduce``: hsgd's shared-memory average vs MPI Allreduce vs gloo;
- ``io``: the contiguous-read loader vs DataLoader, fancy indexing, raw reads;
- ``box``: the parameter box vs a two-sided parameter server;
- ``stall``: what the stall inspector costs a step;
- ``modes``: accuracy, stragglers and load balancing of the ``--sync`` modes;
- ``gossip``: traffic and accuracy of adaptive gossip;
- ``lars``: large batches, SGD vs scaled SGD vs LARS;
- ``diloco``: hierarchical DiLoCo and streaming DiLoCo vs synchronous and local SGD;
- ``faults``: every fault hsgd handles, injected, and how the job ended;
- ``model``: predicted communication per step on clusters of up to 4096 nodes;
- ``train``: training steps side by side with torch DDP, torch's model averagers and Horovod.

A subcommand module has a docstring (its ``--help``: what is measured and
how), ``add_arguments(parser)`` and ``run(args, extra) -> Result``
(:class:`hsgd.bench._harness.Result`: its tables and raw measurements); one
that runs on every rank of an MPI job also has ``worker(args)``, called
under ``mpiexec`` (see :func:`hsgd.bench._launch.run_workers`). Optional:
``check(args, extra, parser)``, which calls ``parser.error`` on settings that
cannot run, before anything starts, and ``PASSES_ON = True`` to receive the
options it does not know in ``extra`` (for ``python -m hsgd.train``) instead
of rejecting them. Adding a subcommand is one module and one line in
:data:`SUBCOMMANDS`.
"""

__all__ = ["SUBCOMMANDS"]

#: The subcommands, in ``--help`` order; each is the module ``hsgd.bench.<name>``.
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
    "model",
    "train",
)
