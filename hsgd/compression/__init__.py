"""Compression of the inter-node level: how the node sums cross nodes.

``compression=`` on the hierarchical modes (``--compression`` in the trainer) takes a name,
``"fp16"``, ``"bf16"`` (:class:`Half`), ``"int8"`` (:class:`Int8`), ``"int4"``
(:class:`Int4`) or ``"powersgd"`` (:class:`PowerSGD`), or a codec object with its settings,
e.g. ``PowerSGD(rank=4, start_step=10, min_compression_rate=2)``; DiLoCo's pseudo-gradients
take those of ``OUTER_COMPRESSIONS`` (``outer_compression=``). Only the sums across nodes
change; inside a node the sums stay exact in shared memory, so a node sends one compressed
message per round and keeps one error-feedback state. With one node nothing is compressed.
The traffic counters (``inter_bytes``) count what is sent, scales included.
When to use which: docs/compression.md; the interface a codec implements:
:mod:`hsgd.compression.codec`.

Example::

    >>> opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, compression=PowerSGD(rank=4))
"""

from __future__ import annotations

from typing import Literal, Optional, Tuple, Union, get_args

from ..errors import InputTypeError
from .codec import Channel, Codec, CodecChoice, Part
from .half import Half
from .int8 import Int4, Int8
from .powersgd import PowerSGD

__all__ = ["COMPRESSIONS", "Compression", "OUTER_COMPRESSIONS", "OuterCompression", "Codec", "Channel", "Part",
           "Half", "Int8", "Int4", "PowerSGD", "codec_of", "CodecChoice", "DEFAULT_POWERSGD_RANK"]

#: The compressions by name, as a type (what ``compression`` takes besides a codec object;
#: ``None`` is ``"none"``).
Compression = Literal["none", "fp16", "bf16", "int8", "int4", "powersgd"]
COMPRESSIONS: Tuple[str, ...] = get_args(Compression)  # the same names, for checks and --compression's choices
#: What DiLoCo's pseudo-gradients take (``outer_compression``): the codecs of any tensor, not PowerSGD's matrices.
OuterCompression = Literal["none", "fp16", "bf16", "int8", "int4"]
OUTER_COMPRESSIONS: Tuple[str, ...] = get_args(OuterCompression)
DEFAULT_POWERSGD_RANK = PowerSGD.rank  # compression="powersgd"'s rank unless told (--powersgd-rank)


def codec_of(compression: Union[None, str, Codec], powersgd_rank: int = DEFAULT_POWERSGD_RANK) -> Optional[Codec]:
    """The codec ``compression`` names (``None`` for ``None`` or ``"none"``), or the codec
    object itself; ``"powersgd"`` is ``PowerSGD(rank=powersgd_rank)``."""
    if compression is None or compression == "none":
        return None
    if isinstance(compression, Codec):
        return compression
    if compression in ("fp16", "bf16"):
        return Half(compression)
    if compression == "int8":
        return Int8()
    if compression == "int4":
        return Int4()
    if compression == "powersgd":
        return PowerSGD(rank=powersgd_rank)
    raise InputTypeError(f"compression must be one of {', '.join(COMPRESSIONS)} or a hsgd.compression codec, "
                         f"got {compression!r}")
