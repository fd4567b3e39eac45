"""``python -m hsgd.bench SUBCOMMAND [options]``: run one benchmark, print its tables.

Each subcommand is a module of ``hsgd.bench`` (see :data:`hsgd.bench.SUBCOMMANDS`).
Its options, ``--json PATH`` and ``--progress`` are parsed here; a subcommand
with ``PASSES_ON`` passes options it does not know on to ``python -m hsgd.train``,
the others reject them. The lab beside the package (``python -m lab.bench``) runs
its own subcommands through the same :func:`main`. A bad option prints
one ``error:`` line and exits with status 2, before anything runs. Under
``mpiexec`` (``--worker-out``, set by :func:`hsgd.bench._launch.run_workers`)
every rank runs the subcommand's ``worker(args)`` and rank 0 writes its
result there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import List, Mapping, Optional, Sequence, Union

from . import SUBCOMMANDS
from ._harness import add_common_options, has_tqdm, write_json

__all__ = ["main", "build_parser"]


def _summary(module) -> str:
    return (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


Subcommands = Union[Sequence[str], Mapping[str, str]]


def build_parser(package: str = "hsgd.bench", subcommands: Subcommands = SUBCOMMANDS,
                 description: str = "Benchmarks of hsgd") -> argparse.ArgumentParser:
    """The parser of ``python -m PACKAGE``: one subparser per subcommand, from its module
    ``PACKAGE.<module>`` (``subcommands``: names that are their modules' names, or a mapping
    of names to module names)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {package}", description=f"{description}: each subcommand prints a "
        "markdown table; --json PATH also writes the raw measurements. "
        f"'python -m {package} SUBCOMMAND --help' says what it measures and how.")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    modules = subcommands if isinstance(subcommands, Mapping) else {name: name for name in subcommands}
    for name, module_name in modules.items():
        module = importlib.import_module(f"{package}.{module_name}")
        sub = subparsers.add_parser(name, help=_summary(module), description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter,
                                    prog=f"python -m {package} {name}", allow_abbrev=False)
        module.add_arguments(sub)
        add_common_options(sub)
        sub.set_defaults(module=module, parser=sub)
    return parser


def main(argv: Optional[Sequence[str]] = None, package: str = "hsgd.bench",
         subcommands: Subcommands = SUBCOMMANDS, description: str = "Benchmarks of hsgd") -> int:
    """Run ``python -m PACKAGE SUBCOMMAND [options]`` (``argv``: the words after the package)."""
    words: List[str] = list(sys.argv[1:] if argv is None else argv)
    args, extra = build_parser(package, subcommands, description).parse_known_args(words)
    args._package = package  # the jobs it starts run python -m PACKAGE
    module, parser = args.module, args.parser
    if extra and not getattr(module, "PASSES_ON", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args._argv = words[words.index(args.subcommand) + 1:]  # for the workers and the JSON record
    if args._worker_out is not None:
        return _worker(module, args)
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"argument --json: the directory {args.json.parent} does not exist: "
                     "create it or write the file elsewhere")
    if args.progress == "bar" and not has_tqdm():
        parser.error("argument --progress: bar needs tqdm (pip install tqdm); or use --progress lines")
    check = getattr(module, "check", None)
    if check is not None:
        check(args, extra, parser)  # parser.error() on settings that cannot run
    result = module.run(args, extra)
    print("\n\n".join(table.markdown() for table in result.tables), flush=True)
    if args.json is not None:
        write_json(args.json, args.subcommand, args, extra, result)
        print(f"\nraw measurements: {args.json}", file=sys.stderr)
    return 0


def _worker(module, args) -> int:
    """Under mpiexec: every rank measures; rank 0 writes the result for the launching process."""
    from mpi4py import MPI

    from hsgd.faults import protect

    protect(MPI.COMM_WORLD)  # an exception on one rank aborts the job; MPI's files unlinked once attached
    result = module.worker(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        args._worker_out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
