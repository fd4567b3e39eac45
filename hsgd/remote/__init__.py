"""Remote memory as a device: one-sided MPI (RMA) regions.

:class:`RemoteMemory` is a sharded region that ranks write, read and
accumulate into with no work by the owners (:mod:`hsgd.remote.memory`). It is
transport: the parameter box's modes (:mod:`hsgd.box`), the stall inspector
(``hsgd.faults.stall``) and the trainer's stop are built on it.
"""

from .memory import RemoteMemory

__all__ = ["RemoteMemory"]
