"""Benchmarks for your own cluster: ``python -m hsgd.bench SUBCOMMAND [options]``.

How fast hsgd averages against MPI and gloo (``allreduce``), how fast it trains
against torch's DDP, model averagers and Horovod (``train``), and what staging a GPU's
gradients through host memory costs against the copy floor (``staging``). Every subcommand launches
``mpiexec`` on itself, takes ``--repeats`` timed runs after ``--warmup`` untimed ones,
prints a markdown table of medians and can write the raw measurements (``--json PATH``)::

    python -m hsgd.bench --help                      # the subcommands
    python -m hsgd.bench allreduce --ranks 2 --sizes 1e6 --repeats 5
    python -m hsgd.bench train --ranks 4 --workloads mlp --repeats 3
    python -m hsgd.bench staging --device cuda --ranks 1 2

The investigations and the runs across emulated hosts are the lab's, beside the package
in a clone (``python -m lab.bench --help``). How each measures: docs/benchmark-methods.md.
"""

__all__ = ["SUBCOMMANDS"]

# A subcommand module has a docstring (its --help: what is measured and how),
# add_arguments(parser) and run(args, extra) -> Result (hsgd.bench._harness.Result: its tables
# and raw measurements); one that runs on every rank of an MPI job also has worker(args), called
# under mpiexec (hsgd.bench._launch.run_workers). Optional: check(args, extra, parser), which
# calls parser.error on settings that cannot run, before anything starts, and PASSES_ON = True
# to receive the options it does not know in extra (for python -m hsgd.train) instead of
# rejecting them. Adding a subcommand is one module and one line here.
#: The subcommands, in ``--help`` order, and their modules ``hsgd.bench.<module>`` (``train``'s is
#: not train.py: no two modules of hsgd share a file name).
SUBCOMMANDS = {
    "allreduce": "allreduce",
    "train": "training_steps",
    "staging": "staging",
}
