"""hsgd: hierarchical synchronous SGD for PyTorch over MPI shared memory.

What users import lives here; the synchronization modes by family in
subpackages (:mod:`hsgd.hierarchical`), private internals in ``hsgd._*``.

Example::

    >>> from hsgd import HierarchicalSGD, Topology
    >>> opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
"""

__version__ = "0.1.0"

from ._engine.mode import SyncMode  # noqa: E402
from .broadcast import broadcast_optimizer_state, broadcast_parameters  # noqa: E402
from .errors import InputError, InputFileNotFoundError, InputPermissionError, InputTypeError, InputValueError  # noqa: E402
from .hierarchical import HierarchicalLocalSGD, HierarchicalSGD  # noqa: E402
from .lars import LARS  # noqa: E402
from .parallel_io import ContiguousH5Loader  # noqa: E402
from .schedules import WarmupMultiStepLR, WarmupPolyLR, scaled_lr  # noqa: E402
from .topology import Topology  # noqa: E402

__all__ = ["HierarchicalSGD", "HierarchicalLocalSGD", "SyncMode", "Topology", "ContiguousH5Loader",
           "LARS", "WarmupPolyLR", "WarmupMultiStepLR", "scaled_lr", "broadcast_parameters",
           "broadcast_optimizer_state", "InputError", "InputValueError", "InputTypeError",
           "InputFileNotFoundError", "InputPermissionError", "__version__"]
