"""On the ``PYTHONPATH`` of a job (tests/e2e): the autocast probe's child process
(:mod:`hsgd.amp`, ``python -c CODE cpu DTYPE``) dies of SIGILL, as on a CPU that advertises AMX
its hypervisor does not enable, with ``ONEDNN_MAX_CPU_ISA`` set or not. Every other Python of
the job starts as usual. Python imports this module at start-up, before the command runs.
"""

import signal
import sys

if sys.argv[0] == "-c" and sys.argv[1:2] == ["cpu"]:  # the probe; the ranks run -m or a script
    signal.raise_signal(signal.SIGILL)
