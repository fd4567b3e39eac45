"""A Python in which bf16 autocast fails as on a CPU that advertises AMX its hypervisor does not
enable, for :func:`hsgd.amp.probe_autocast`'s ``python=`` (tests/unit/test_amp.py).

``python faulty_python.py KIND ARGS...`` fails as KIND says, before any torch is imported:
``sigill`` (it kills itself with SIGILL), ``primitive`` (it raises ``RuntimeError: could not
create a primitive``) or ``hang`` (it sleeps past any timeout). With the suffix ``:uncapped``
(``sigill:uncapped``) it fails only while ``ONEDNN_MAX_CPU_ISA`` is unset, as on the machine of
the report, and otherwise runs ``python ARGS...`` (this Python, in this process).
"""

import os
import signal
import sys
import time

kind, _, when = sys.argv[1].partition(":")
if not (when == "uncapped" and os.environ.get("ONEDNN_MAX_CPU_ISA")):
    if kind == "sigill":
        signal.raise_signal(signal.SIGILL)
    if kind == "primitive":
        raise RuntimeError("could not create a primitive")
    if kind == "hang":
        time.sleep(3600)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
