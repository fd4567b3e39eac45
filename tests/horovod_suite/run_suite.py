"""Run Horovod's own ``test/parallel/test_torch.py`` against ``hsgd.horovod`` and count the results.

Horovod's file is Apache-licensed code from elsewhere: it is not in this repository. Fetch
it (``git show 2626dc87:test/parallel/test_torch.py`` in a clone of horovod/horovod, or
v0.28.1's, which is the same file) and pass its path::

    python tests/horovod_suite/run_suite.py /path/to/test_torch.py --ranks 2 4
    .venv-openmpi/bin/python tests/horovod_suite/run_suite.py /path/to/test_torch.py   # under Open MPI

In a temporary folder the file is copied with one line changed (``import horovod.torch as
hvd`` -> ``import hsgd.horovod as hvd``) beside ``common.py`` (this folder's stand-in for
Horovod's helpers), then run by pytest on every rank under this Python's ``mpiexec``. A test
counts as passed when it passed on every rank, skipped when it skipped on every rank;
anything else is a failure, listed with each rank's first line. Prints one table per rank
count; ``--json FILE`` writes the counts and the failures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # hsgd from the checkout, when run as a script

from hsgd.bench._launcher import JobHung, mpi_command, mpi_env, mpi_flavour, run_job  # noqa: E402

IMPORT = "import horovod.torch as hvd"
RANK_MAIN = '''import os, sys, pytest
rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
here = os.path.dirname(os.path.abspath(__file__))
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-c", os.path.join(here, "pytest.ini"),
                      "--junitxml", os.path.join(here, f"rank{rank}.xml"), *sys.argv[1:],
                      os.path.join(here, "test_torch.py")]))
'''


def prepare(source: Path, folder: Path) -> None:
    """``folder``: Horovod's test file with the import changed, the stand-in, a per-rank main."""
    text = source.read_text()
    if text.count(IMPORT) != 1:
        raise SystemExit(f"{source}: expected the line {IMPORT!r} once, found it {text.count(IMPORT)} times")
    (folder / "test_torch.py").write_text(text.replace(IMPORT, "import hsgd.horovod as hvd"))
    shutil.copy(HERE / "common.py", folder / "common.py")
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "rank_main.py").write_text(RANK_MAIN)


def outcomes(folder: Path, ranks: int) -> Dict[str, List[str]]:
    """Per test, each rank's outcome (``passed``, ``skipped``, ``failed: first line``, ``missing``)."""
    found: Dict[str, List[str]] = {}
    for rank in range(ranks):
        path = folder / f"rank{rank}.xml"
        cases = ET.parse(path).getroot().iter("testcase") if path.exists() else []
        for case in cases:
            name = case.get("name", "?")
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                message = (problem.get("message") or problem.text or "").strip().splitlines()
                outcome = "failed: " + (message[0] if message else "")[:200]
            else:
                outcome = "skipped" if case.find("skipped") is not None else "passed"
            found.setdefault(name, ["missing"] * ranks)[rank] = outcome
    return found


def run(source: Path, ranks: int, timeout: float, extra: List[str], env: Dict[str, str]) -> Dict:
    """One job of ``ranks`` ranks; its counts and failures."""
    with tempfile.TemporaryDirectory(prefix="hsgd-horovod-suite-") as tmp:
        folder = Path(tmp)
        prepare(source, folder)
        cmd = mpi_command(ranks, [str(folder / "rank_main.py"), *extra])
        try:
            proc = run_job(cmd, mpi_env({"PYTHONPATH": str(HERE.parents[1]), **env}), timeout=timeout)
            hung, tail = None, (proc.stdout + proc.stderr)[-3000:]
        except JobHung as exc:
            hung, tail = str(exc), (exc.out + exc.err)[-3000:]
        found = outcomes(folder, ranks)
    passed = sorted(n for n, o in found.items() if all(x == "passed" for x in o))
    skipped = sorted(n for n, o in found.items() if all(x == "skipped" for x in o))
    failed = {n: o for n, o in sorted(found.items()) if n not in passed and n not in skipped}
    ran = len(found) - len(skipped)
    return {"ranks": ranks, "mpi": mpi_flavour(), "tests": len(found), "skipped": len(skipped), "ran": ran,
            "passed": len(passed), "failed": failed, "fraction": len(passed) / ran if ran else 0.0,
            "hung": hung, "output_tail": tail if hung or not found else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_torch", type=Path, nargs="?", default=os.environ.get("HSGD_HOROVOD_TEST_TORCH"),
                        help="Horovod's test/parallel/test_torch.py (default: $HSGD_HOROVOD_TEST_TORCH)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts (2 4)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job before it is killed (1800)")
    parser.add_argument("--stall", default="120", help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS in the job (120): a "
                        "rank that waits that long for the others raises instead of hanging the run")
    parser.add_argument("-k", dest="select", help="pytest -k expression")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.test_torch is None or not Path(args.test_torch).is_file():
        parser.error("pass the path of Horovod's test/parallel/test_torch.py (or set HSGD_HOROVOD_TEST_TORCH)")
    extra = ["-k", args.select] if args.select else []
    env = {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": args.stall}
    results = [run(Path(args.test_torch), n, args.timeout, extra, env) for n in args.ranks]
    for r in results:
        print(f"{r['mpi']}, {r['ranks']} ranks: {r['passed']} of {r['ran']} tests that ran passed "
              f"({100 * r['fraction']:.0f}%), {r['skipped']} skipped, {r['tests']} in all"
              + (" - THE JOB HUNG and was killed" if r["hung"] else ""))
        for name, per_rank in r["failed"].items():
            print(f"  FAILED {name}: " + " | ".join(f"rank {i}: {o}" for i, o in enumerate(per_rank)))
        if r["output_tail"]:
            print(r["output_tail"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["fraction"] >= 0.75 and not r["hung"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
