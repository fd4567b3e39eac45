"""hsgd: hierarchical synchronous SGD for PyTorch over MPI shared memory.

What users import lives here; the synchronization modes by family in subpackages
(:mod:`hsgd.hierarchical`, :mod:`hsgd.box`, :mod:`hsgd.gossip`), remote memory in
:mod:`hsgd.remote`, faults in :mod:`hsgd.faults`, private internals in ``hsgd._*``.

Example::

    >>> from hsgd import HierarchicalSGD, Topology
    >>> opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "SyncMode": "._engine.mode",
    "HierarchicalSGD": ".hierarchical", "HierarchicalLocalSGD": ".hierarchical", "HierarchicalDiLoCo": ".hierarchical",
    "RemoteMemory": ".remote", "ElasticSGD": ".box", "AsyncSGD": ".box",
    "GossipSGD": ".gossip",
    "Topology": ".topology", "ContiguousH5Loader": ".parallel_io", "LoadBalancer": ".balance",
    "LARS": ".lars",
    "WarmupPolyLR": ".schedules", "WarmupMultiStepLR": ".schedules", "scaled_lr": ".schedules",
    "broadcast_parameters": ".replicas", "broadcast_optimizer_state": ".replicas",
    "pick_device": ".devices",
    **{name: ".collectives" for name in (
        "rank", "size", "local_rank", "local_size", "barrier", "allreduce", "allreduce_", "allgather",
        "broadcast", "broadcast_", "allreduce_object", "allgather_object", "broadcast_object")},
    "InputError": ".errors", "InputValueError": ".errors", "InputTypeError": ".errors",
    "InputFileNotFoundError": ".errors", "InputPermissionError": ".errors",
}

__all__ = [*_EXPORTS, "__version__"]


# The names are loaded on first use (PEP 562), so that ``import hsgd`` and the commands that
# need no MPI (python -m hsgd.report) do not start it: ``from mpi4py import MPI`` initializes
# MPI, which outside a launcher makes a singleton process (that some MPIs cannot start on a
# login node, and Open MPI 5 leaves a /dev/shm/sm_segment.* file behind for).
def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
