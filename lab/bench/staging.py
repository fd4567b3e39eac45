# The package's ``staging`` benchmark, here so that the lab runs every subcommand the package
# has (tests/e2e/test_bench.py): ``python -m lab.bench staging`` is ``python -m hsgd.bench staging``.
from hsgd.bench import staging as _package
from hsgd.bench.staging import add_arguments, check, run, worker  # noqa: F401

__doc__ = _package.__doc__
