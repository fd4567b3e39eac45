"""hsgd: hierarchical synchronous SGD for PyTorch over MPI shared memory.

Example::

    >>> from hsgd import HierarchicalSGD, Topology
    >>> opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
"""

__version__ = "0.1.0"

from .broadcast import broadcast_optimizer_state, broadcast_parameters  # noqa: E402
from .lars import LARS  # noqa: E402
from .hierarchical.synchronous import HierarchicalSGD  # noqa: E402
from .parallel_io import ContiguousH5Loader  # noqa: E402
from .schedules import WarmupMultiStepLR, WarmupPolyLR, scaled_lr  # noqa: E402
from .topology import Topology  # noqa: E402

__all__ = ["HierarchicalSGD", "Topology", "ContiguousH5Loader", "LARS", "WarmupPolyLR", "WarmupMultiStepLR",
           "scaled_lr", "broadcast_parameters", "broadcast_optimizer_state", "__version__"]
