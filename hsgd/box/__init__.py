"""The parameter box: global weights in remote memory, and the modes that train against them.

- :class:`ElasticSGD`: SEASGD, an elastic pull towards the global weights every ``tau`` steps;
- :class:`AsyncSGD`: asynchronous SGD, every step's change accumulated into the global weights;
- both on :class:`BoxEngine`, a :class:`~hsgd.remote.RemoteMemory` region (:mod:`hsgd.box.box_sgd`).
"""

from .box_sgd import AsyncSGD, BoxEngine, ElasticSGD

__all__ = ["ElasticSGD", "AsyncSGD", "BoxEngine"]
