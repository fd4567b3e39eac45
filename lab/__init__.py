"""The lab: hsgd's investigations, kept beside the package, not in the wheel.

Run from a clone's root, one command each (docs/benchmarks.md)::

    python -m lab.bench --help            # every investigation: io, box, stall, modes, gossip,
                                          # lars, diloco, faults, model, and allreduce/train --hosts
    python -m lab.hosts run --hosts 2 -- python -m hsgd.train --epochs 1   # as root

What a user measures on their own cluster after ``pip install hsgd`` stays in the
package: ``python -m hsgd.bench`` (allreduce, and train against DDP). The lab imports
hsgd; hsgd never imports the lab.

Importing the lab puts the clone's root on ``PYTHONPATH``, so that the processes it starts
(the ranks of its MPI jobs, on emulated hosts too, and the hosts' guard) find it wherever
they start.
"""

import os
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
