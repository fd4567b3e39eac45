"""hsgd.amp: autocast tried in a child process; a crash is told in one line with its fix.

The crashes of the report (SIGILL, "could not create a primitive") cannot happen on a
machine whose CPU works: the probe runs its child in a Python that simulates them
(``python=``, tests/amp_faults/faulty_python.py). No MPI here.
"""

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from hsgd import amp

FAULTY_PYTHON = Path(__file__).resolve().parents[1] / "amp_faults" / "faulty_python.py"

FIX = "export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 before starting the job, or use --amp none"


def faulty(kind):
    """``python=`` for a child that fails as ``kind`` says (sigill, primitive or hang; with
    ``:uncapped`` only while ONEDNN_MAX_CPU_ISA is unset): tests/amp_faults/faulty_python.py."""
    return [sys.executable, str(FAULTY_PYTHON), kind]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No ISA cap and no cached answer unless a test sets them."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    amp._RESULTS.clear()
    yield
    amp._RESULTS.clear()


@pytest.fixture
def children(monkeypatch):
    """The child processes hsgd.amp starts (they still run): (command line, ONEDNN_MAX_CPU_ISA)."""
    started = []
    real = subprocess.run

    def counted(cmd, **kwargs):
        started.append((cmd, (kwargs.get("env") or {}).get("ONEDNN_MAX_CPU_ISA")))
        return real(cmd, **kwargs)
    # a stand-in for the module as hsgd.amp sees it: the tests' own subprocess calls are not counted
    monkeypatch.setattr(amp, "subprocess", types.SimpleNamespace(run=counted,
                                                                  TimeoutExpired=subprocess.TimeoutExpired))
    return started


def probe(dtype=torch.bfloat16, **kwargs):
    problem = amp.probe_autocast("cpu", dtype, off="use --amp none", **kwargs)
    assert problem is None or "\n" not in problem, problem
    return problem


def capped_check_fails():
    """Why bf16 autocast fails here even under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (None: it works)."""
    proc = subprocess.run([sys.executable, "-c", amp._CHILD, "cpu", "bfloat16"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "ONEDNN_MAX_CPU_ISA": amp.ISA_CAP})
    return None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-300:]}"


def test_sigill_names_the_signal_and_the_variable_that_fixes_it(monkeypatch, children):
    """As on the machine of the report: the child dies of SIGILL unless the ISA is capped."""
    why = capped_check_fails()
    if why:
        pytest.skip(f"bf16 autocast fails here even with ONEDNN_MAX_CPU_ISA={amp.ISA_CAP}: {why}")
    problem = probe(python=faulty("sigill:uncapped"))
    assert problem == ("bfloat16 autocast on the CPU killed a test process with SIGILL (illegal instruction: "
                       "the CPU advertises an instruction set (AMX?) that this machine does not enable); "
                       f"with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 it works: {FIX}")
    assert [cap for _, cap in children] == [None, amp.ISA_CAP]  # the fix was tried before it is offered


def test_a_crash_the_variable_does_not_fix_says_to_leave_mixed_precision_off(children):
    problem = probe(python=faulty("sigill"))
    assert problem.startswith("bfloat16 autocast on the CPU killed a test process with SIGILL (illegal "
                              "instruction: the CPU advertises an instruction set (AMX?)"), problem
    assert problem.endswith(", and with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 too: use --amp none"), problem
    assert "export" not in problem and len(children) == 2


def test_could_not_create_a_primitive_is_quoted():
    problem = probe(torch.float16, python=faulty("primitive"))
    assert problem == ("float16 autocast on the CPU failed in a test process: RuntimeError: could not create "
                       "a primitive, and with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 too: use --amp none")


def test_with_the_variable_already_set_nothing_more_is_tried(monkeypatch, children):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", amp.ISA_CAP)
    problem = probe(python=faulty("primitive"))
    assert problem == ("bfloat16 autocast on the CPU failed in a test process: RuntimeError: could not create "
                       "a primitive (with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16): use --amp none")
    assert len(children) == 1


def test_a_hang_is_cut_by_the_timeout():
    start = time.monotonic()
    problem = probe(timeout=1.5, python=faulty("hang"))
    assert problem.startswith("bfloat16 autocast on the CPU did not finish in 1.5 s in a test process"), problem
    assert time.monotonic() - start < 30  # two children, each killed at its timeout


def test_working_autocast_is_ok(children):
    problem = probe()
    if problem is not None:  # the probe must be wrong, unless the machine really cannot
        direct = subprocess.run([sys.executable, "-c", "import torch\nwith torch.autocast('cpu', "
                                 "dtype=torch.bfloat16):\n    torch.nn.Linear(64, 64)(torch.randn(32, 64))"
                                 ".float().sum().backward()"], capture_output=True, timeout=120)
        assert direct.returncode != 0, f"bf16 autocast works here, yet the probe says: {problem}"
        pytest.skip(f"bf16 autocast does not work on this machine: {problem}")
    assert len(children) == 1


def test_a_dtype_torch_does_not_autocast_to_is_named(children):
    """CPU autocast takes bfloat16 and float16 only: torch runs float32 instead and warns."""
    problem = probe(torch.float64)
    assert problem == (f"torch {torch.__version__} does not autocast to float64 on the CPU (the layer ran "
                       f"in float32): use --amp none")
    assert len(children) == 1  # no ISA cap makes torch autocast to it


def test_the_answer_is_cached_per_process(children):
    primitive = faulty("primitive")
    first = probe(python=primitive)
    assert len(children) == 2
    assert probe(python=primitive) == first and len(children) == 2  # no child started again
    assert amp.probe_autocast("cpu", torch.bfloat16, off="drop --use-mixed-precision", python=primitive).endswith(
        "too: drop --use-mixed-precision") and len(children) == 2
    # another Python: asked again
    assert "SIGILL" in probe(python=faulty("sigill")) and len(children) == 4


def test_other_devices_are_not_probed(children):
    assert amp.probe_autocast("cuda", torch.float16) is None and children == []


def test_the_first_failing_rank_speaks_naming_its_host_if_there_are_several():
    assert amp._first_problem([("a", None), ("a", None)]) is None
    assert amp._first_problem([("a", None), ("a", "x"), ("a", "y")]) == "x"
    assert amp._first_problem([("a", None), ("b", "x"), ("c", "y")]) == "on b: x"


def test_importing_it_starts_no_mpi():
    code = "import sys, hsgd.amp; sys.exit('mpi4py.MPI' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
