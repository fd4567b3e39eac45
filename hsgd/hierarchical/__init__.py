"""The hierarchical family: two-level averaging over a node's shared memory and
across nodes. :class:`HierarchicalSGD` averages gradients every step
(synchronous SGD); :class:`HierarchicalLocalSGD` takes local steps and
averages parameters periodically, and :class:`HierarchicalDiLoCo` makes its
global round DiLoCo's outer step (:mod:`hsgd.hierarchical.outer`); all run on
:class:`HierarchicalAverager`."""

from .averager import HierarchicalAverager
from .local_sgd import HierarchicalDiLoCo, HierarchicalLocalSGD
from .synchronous import HierarchicalSGD

__all__ = ["HierarchicalAverager", "HierarchicalSGD", "HierarchicalLocalSGD", "HierarchicalDiLoCo"]
