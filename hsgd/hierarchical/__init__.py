"""The hierarchical family: two-level averaging over a node's shared memory and
across nodes. :class:`HierarchicalSGD` averages gradients every step
(synchronous SGD); :class:`HierarchicalLocalSGD` takes local steps and
averages parameters periodically; both run on :class:`HierarchicalAverager`."""

from .averager import HierarchicalAverager
from .local_sgd import HierarchicalLocalSGD
from .synchronous import HierarchicalSGD

__all__ = ["HierarchicalAverager", "HierarchicalSGD", "HierarchicalLocalSGD"]
