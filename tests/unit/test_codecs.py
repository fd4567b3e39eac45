"""The codecs' parts that need no MPI: int8's rounding, PowerSGD's orthogonalization and choice of
matrices, names and objects as ``compression``, and the trainer's flags for them."""

import math

import pytest
import torch

from hsgd import InputTypeError, InputValueError
from hsgd._trainer.config import parse_config
from hsgd._trainer.mode_flags import mode_settings
from hsgd.compression import COMPRESSIONS, CodecChoice, Half, Int4, Int8, PowerSGD, codec_of
from hsgd.compression.int8 import dequantize, pack, quantize, unpack
from hsgd.compression.powersgd import orthogonalize
from hsgd.intra_node import Layout


def test_int8_rounds_each_value_by_at_most_half_a_step_of_its_block():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(50, 256, generator=gen) * torch.logspace(-6, 3, 50)[:, None]
    values[3] = 0.0  # a zero block stays zero
    scales, q = quantize(values, 127)
    back = dequantize(scales, q, values.dtype)
    step = values.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((back - values).abs() <= step / 2 * (1 + 1e-5)).all())
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and bool((back[3] == 0).all())


def test_int8_turns_a_non_finite_block_into_non_finite_values():
    """Inf or NaN in a block must not decode as numbers: the step is then skipped on every rank."""
    values = torch.ones(3, 8)
    values[0, 2], values[1, 5] = float("inf"), float("nan")
    back = dequantize(*quantize(values, 127), values.dtype)
    assert not bool(torch.isfinite(back[0]).any()) and not bool(torch.isfinite(back[1]).any())
    assert torch.equal(back[2], values[2])


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space(rank):
    a = torch.randn(30, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    q = a.clone()
    orthogonalize(q)
    torch.testing.assert_close(q.t() @ q, torch.eye(rank, dtype=torch.float64))
    torch.testing.assert_close(q @ (q.t() @ a), a)  # a lies in the span of q


def test_orthogonalize_leaves_a_zero_column_zero():
    q = torch.zeros(5, 2)
    q[:, 0] = 1.0
    orthogonalize(q)
    assert bool(torch.isfinite(q).all()) and bool((q[:, 1] == 0).all())


def test_powersgd_compresses_the_matrices_worth_it():
    codec = PowerSGD(rank=4)  # torch's rule: (n + m) r * rate < n m
    assert codec.compresses((100, 50)) and codec.compresses((64, 8, 3, 3))
    assert not codec.compresses((1000,)) and not codec.compresses((10, 16))  # 208 < 160 is false
    shapes = [(10, 16), (5,)]
    with pytest.raises(InputValueError, match=r"the largest, 10x16, takes a rank of at most 3"):
        codec.check_layout(Layout([(torch.float32, math.prod(s)) for s in shapes], shapes))
    with pytest.raises(InputValueError, match="has none"):
        codec.check_layout(Layout([(torch.float32, 7)]))
    PowerSGD(rank=3).check_layout(Layout([(torch.float32, 160)], [(10, 16)]))


@pytest.mark.parametrize("codec,match", [(PowerSGD(rank=0), "compression.rank: 0"),
                                         (PowerSGD(start_step=-1), "start_step"),
                                         (PowerSGD(min_compression_rate=0.9), "min_compression_rate"),
                                         (Int8(block=0), "block"), (Half("fp8"), "dtype")])
def test_codec_settings_are_checked(codec, match):
    with pytest.raises(InputValueError, match=match):
        CodecChoice(COMPRESSIONS)("compression", codec)


def test_names_and_objects():
    assert codec_of("none") is None and codec_of(None) is None
    assert codec_of("bf16") == Half("bf16") and codec_of("int8") == Int8()
    assert codec_of("powersgd", 8) == PowerSGD(rank=8)
    mine = PowerSGD(rank=2, start_step=3)
    assert codec_of(mine) is mine and mine.name == "powersgd" and mine.feedback and mine.whole_tensors
    assert not Half().feedback and Int8().feedback and not Int8().whole_tensors
    with pytest.raises(InputTypeError, match="codec object"):
        CodecChoice(COMPRESSIONS)("compression", PowerSGD)


def test_int4_packs_two_values_a_byte_and_back():
    q = torch.arange(-7, 8, dtype=torch.int8).repeat(2)[:28].view(2, 14)
    packed = pack(q, 4)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 7)
    assert torch.equal(unpack(packed, 4), q) and torch.equal(unpack(pack(q, 8), 8), q)
    assert codec_of("int4") == Int4() and Int4().name == "int4" and Int4().feedback
    with pytest.raises(InputValueError, match="even"):
        Int4(block=255).check("outer_compression")


def test_trainer_flags_name_the_codec():
    outer = mode_settings(parse_config(["--sync", "diloco", "--outer-compression", "int4"])).outer_codec()
    assert outer == Int4(tensor_blocks=False)  # the pseudo-gradients' blocks run on across tensors
    settings = mode_settings(parse_config(["--compression", "powersgd", "--powersgd-rank", "2"]))
    assert settings.codec() == PowerSGD(rank=2)
    assert mode_settings(parse_config(["--compression", "int8"])).codec() == Int8()


@pytest.mark.parametrize("argv,problem", [
    (["--compression", "int8", "--sync", "gossip"], "--sync gossip has none: use --sync sync"),
    (["--compression", "powersgd", "--sync", "elastic"], "--sync elastic has none: use --sync sync"),
    (["--compression", "int8", "--sync", "local"], "local SGD averages parameters"),
    (["--compression", "powersgd", "--sync", "diloco"], "pass --outer-compression int8 instead of --compression"),
    (["--compression", "fp16", "--sync", "diloco"], "pass --outer-compression fp16 instead of --compression fp16"),
    (["--outer-compression", "int8"], "--sync sync has none: use --sync diloco, or --compression"),
    (["--outer-compression", "fp16", "--sync", "local"], "--sync local has none: use --sync diloco"),
    (["--compression", "powersgd", "--inter-node", "sharded"], "--inter-node leader"),
    (["--compression", "int8", "--powersgd-rank", "2"], "--powersgd-rank sets the rank of --compression powersgd"),
    (["--compression", "powersgd", "--powersgd-rank", "0"], "Invalid --powersgd-rank: 0"),
])
def test_trainer_refuses_what_the_codecs_cannot_do(argv, problem):
    assert problem in parse_config(argv).validate()


def test_trainer_takes_16_bits_anywhere_it_took_them():
    assert parse_config(["--compression", "fp16", "--sync", "local"]).validate() is None
    assert parse_config(["--compression", "int8", "--inter-node", "sharded"]).validate() is None
