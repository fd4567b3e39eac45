"""Remote memory as a device: one-sided MPI (RMA) regions and the modes built on them.

- :class:`RemoteMemory`: a sharded region that ranks write, read and
  accumulate into with no work by the owners (:mod:`hsgd.remote.memory`);
- :class:`ElasticSGD` and :class:`AsyncSGD`: training against global
  weights kept in such a region, the parameter box (:mod:`hsgd.remote.box`).
"""

from .box import AsyncSGD, ElasticSGD
from .memory import RemoteMemory

__all__ = ["RemoteMemory", "ElasticSGD", "AsyncSGD"]
