"""hsgd: hierarchical synchronous SGD for PyTorch over MPI shared memory."""

__version__ = "0.1.0"

from .topology import Topology  # noqa: E402

__all__ = ["Topology", "__version__"]
