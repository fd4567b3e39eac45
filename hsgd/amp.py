"""Mixed precision on the CPU: find out in a child process whether autocast works here.

On some machines bf16 autocast on the CPU kills the process that tries it: the CPU
advertises AMX, oneDNN (torch's CPU kernels) picks its AMX kernels, the hypervisor has
not enabled AMX, and the first bf16 matrix product dies of SIGILL (or oneDNN fails with
"could not create a primitive"). Capping oneDNN below AMX with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` avoids it. :func:`probe_autocast` tries it in a
child process and says what to do; :func:`check_autocast` is its collective form.

Example::

    >>> problem = probe_autocast("cpu", torch.bfloat16)
    >>> if problem:
    ...     sys.exit(f"error: {problem}")
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["probe_autocast", "check_autocast", "ISA_CAP", "PROBE_TIMEOUT_S"]

# hsgd does not set ONEDNN_MAX_CPU_ISA itself: oneDNN reads it once, at the process's first
# oneDNN kernel (checked with ONEDNN_VERBOSE=1: set before that it caps the ISA, after it changes
# nothing), and a library cannot tell whether its caller has run one already. Set in the job's
# environment it is read before any kernel runs.
ISA_CAP = "AVX512_CORE_BF16"  # an ISA below AMX, with bf16 instructions (AVX512_BF16)
PROBE_TIMEOUT_S = 120.0
_UNSUPPORTED = 3  # the child's exit status when torch ran the layer without autocasting

# The child: python -c _CHILD DEVICE DTYPE.
_CHILD = r"""
import sys
import torch
torch.set_num_threads(1)
device, dtype = sys.argv[1], getattr(torch, sys.argv[2])
torch.manual_seed(0)
layer, conv = torch.nn.Linear(64, 64).to(device), torch.nn.Conv1d(4, 8, 3).to(device)
x = torch.randn(32, 64, device=device)
with torch.autocast(device, dtype=dtype):
    out, maps = layer(x), conv(x.view(32, 4, 16))
    loss = out.float().square().mean() + maps.float().square().mean()
loss.backward()
if out.dtype != dtype:
    print(f"torch {torch.__version__} does not autocast to {sys.argv[2]} on the {device.upper()} "
          f"(the layer ran in {str(out.dtype).replace('torch.', '')})", file=sys.stderr)
    sys.exit(3)
"""

_SIGNALS = {
    signal.SIGILL: "illegal instruction: the CPU advertises an instruction set (AMX?) that this "
                   "machine does not enable",
}

# (device type, dtype, ONEDNN_MAX_CPU_ISA, the child's Python) -> (what went wrong, or None;
# whether the check passes under ISA_CAP: True, False, or None when not tried)
_RESULTS: Dict[Tuple[str, str, Optional[str], Tuple[str, ...]], Tuple[Optional[str], Optional[bool]]] = {}


def probe_autocast(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16, *,
                   off: str = "leave mixed precision off", timeout: float = PROBE_TIMEOUT_S,
                   python: Optional[Sequence[str]] = None) -> Optional[str]:
    """Whether a forward and backward under ``torch.autocast(device_type, dtype)`` works here,
    tried in a child process so that a crash cannot take this one down.

    The child (``sys.executable`` or ``python``, with a timeout) runs a small ``torch.nn.Linear`` and
    ``Conv1d`` forward and backward under autocast. If it failed, a second child runs the
    same check with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` to see whether the cap helps.

    Returns ``None`` if it works (and for any device but ``"cpu"``: nothing to probe), else one
    line: what failed (the signal, the error's last line, or the timeout) and the fix, either
    ``export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (when a second child with it set passed) or
    ``off``, the caller's words for running without mixed precision. ``python``: the command
    line that starts the Python to try it in (default ``[sys.executable]``, this one's; e.g. a
    wrapper that runs it on another machine), to which ``-c CODE DEVICE DTYPE`` is appended.
    Cached per process (per device type, dtype, ``ONEDNN_MAX_CPU_ISA`` and ``python``). Not
    collective: see :func:`check_autocast`.
    """
    if device_type != "cpu":
        return None
    command = [sys.executable] if python is None else list(python)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    key = (device_type, _dtype_name(dtype), cap, tuple(command))
    if key not in _RESULTS:
        _RESULTS[key] = _diagnose(command, device_type, dtype, cap, timeout)
    problem, capped_works = _RESULTS[key]
    if problem is None:
        return None
    if capped_works:
        return (f"{problem}; with ONEDNN_MAX_CPU_ISA={ISA_CAP} it works: export "
                f"ONEDNN_MAX_CPU_ISA={ISA_CAP} before starting the job, or {off}")
    if capped_works is False:
        return f"{problem}, and with ONEDNN_MAX_CPU_ISA={ISA_CAP} too: {off}"
    return f"{problem}: {off}"


def check_autocast(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16, comm=None, *,
                   off: str = "leave mixed precision off", timeout: float = PROBE_TIMEOUT_S,
                   python: Optional[Sequence[str]] = None) -> Optional[str]:
    """:func:`probe_autocast` for an MPI job: the lowest rank of each host probes, and every rank
    of ``comm`` (default the world) gets the same answer, the first failing host's (named when
    the job spans several hosts). Collective."""
    if device_type != "cpu":
        return None
    from mpi4py import MPI  # here: importing hsgd.amp must not start MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        mine = probe_autocast(device_type, dtype, off=off, timeout=timeout, python=python) \
            if host.Get_rank() == 0 else None
    finally:
        host.Free()
    return _first_problem(comm.allgather((MPI.Get_processor_name(), mine)))


def _first_problem(verdicts) -> Optional[str]:
    """The lowest rank's problem among ``(host name, problem or None)`` pairs, one per rank,
    naming its host if the ranks are on several."""
    failed = [(name, problem) for name, problem in verdicts if problem]
    if not failed:
        return None
    name, problem = failed[0]
    return problem if len({name for name, _ in verdicts}) == 1 else f"on {name}: {problem}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _diagnose(command: List[str], device_type: str, dtype: torch.dtype, cap: Optional[str],
              timeout: float) -> Tuple[Optional[str], Optional[bool]]:
    """What went wrong in the child (``None``: nothing) and whether the check passes with
    ``ONEDNN_MAX_CPU_ISA`` capped below AMX (``None``: not tried)."""
    failure, unsupported = _run_child(command, device_type, dtype, timeout)
    if failure is None:
        return None, None
    if unsupported:  # torch does not autocast to this dtype here at all: no ISA cap helps
        return failure, None
    problem = f"{_dtype_name(dtype)} autocast on the {device_type.upper()} {failure}"
    if cap is not None:
        problem = f"{problem} (with ONEDNN_MAX_CPU_ISA={cap})"
    if cap == ISA_CAP:
        return problem, None
    capped, _ = _run_child(command, device_type, dtype, timeout, env={**os.environ, "ONEDNN_MAX_CPU_ISA": ISA_CAP})
    return problem, capped is None


def _run_child(command: List[str], device_type: str, dtype: torch.dtype, timeout: float,
               env: Optional[Dict[str, str]] = None) -> Tuple[Optional[str], bool]:
    """Run the check in a child process: (what went wrong, or ``None``; whether torch merely
    does not autocast to ``dtype`` here)."""
    try:
        proc = subprocess.run([*command, "-c", _CHILD, device_type, _dtype_name(dtype)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout:g} s in a test process (a hung kernel?)", False
    except OSError as exc:
        return f"could not be tried: starting {' '.join(command)} failed ({exc})", False
    if proc.returncode == 0:
        return None, False
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        return f"killed a test process with {sig.name} ({_SIGNALS.get(sig) or signal.strsignal(sig)})", False
    last = next((line.strip() for line in reversed(proc.stderr.splitlines()) if line.strip()),
                f"exit status {proc.returncode}")[:300]
    if proc.returncode == _UNSUPPORTED:
        return last, True
    return f"failed in a test process: {last}", False
