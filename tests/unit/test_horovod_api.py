"""hsgd.horovod's pieces that need no MPI job: scaling, shapes, messages, Horovod's argument checks."""

import warnings

import pytest
import torch

import hsgd.horovod as hvd
from hsgd.horovod import distributed_optimizer, execution, matching, tensor_ops


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8])
def test_an_integer_scale_truncates_toward_zero_as_horovods_cpu_kernel(dtype):
    values = torch.tensor([-7, -3, -1, 0, 1, 3, 7], dtype=dtype)
    got = execution.scaled(values, 0.5)
    assert got.dtype == dtype
    assert got.tolist() == [-3, -1, 0, 0, 0, 1, 3]  # floor would give -4, -2, -1


def test_half_scales_in_float32_and_floats_in_their_own_dtype():
    half = torch.tensor([1.0, 3.0, 2049.0], dtype=torch.float16)
    assert execution.scaled(half, 1 / 3).dtype == torch.float16
    assert torch.equal(execution.scaled(half, 1 / 3), (half.float() * torch.tensor(1 / 3)).half())
    single = torch.tensor([0.1, 1e10], dtype=torch.float32)
    assert torch.equal(execution.scaled(single, 0.3), single * torch.tensor(0.3, dtype=torch.float32))
    assert execution.scaled(single, 1.0) is single


@pytest.mark.parametrize("dim0,size", [(8, 4), (9, 4), (3, 5), (0, 2)])
def test_reducescatter_rows_give_the_first_ranks_the_remainder(dim0, size):
    rows = [execution.reduced_rows(dim0, size, r) for r in range(size)]
    assert sum(rows) == dim0 and max(rows) - min(rows) <= 1 and rows == sorted(rows, reverse=True)


def test_the_identity_a_joined_rank_contributes():
    for op, want in ((hvd.Sum, 0), (hvd.Average, 0), (hvd.Product, 1), (hvd.Min, 2 ** 31 - 1), (hvd.Max, -2 ** 31)):
        assert execution._identity((2,), torch.int32, op).tolist() == [want, want]
    assert execution._identity((1,), torch.float32, hvd.Min).item() == float("inf")


def test_fp16_compression_round_trips_floats_and_leaves_integers():
    t = torch.tensor([1.5, -2.0], dtype=torch.float64)
    small, ctx = hvd.Compression.fp16.compress(t)
    assert small.dtype == torch.float16 and hvd.Compression.fp16.decompress(small, ctx).dtype == torch.float64
    ints = torch.tensor([1, 2])
    same, ctx = hvd.Compression.fp16.compress(ints)
    assert same.dtype == torch.int64 and hvd.Compression.none.compress(ints) == (ints, None)


def test_the_deprecated_average_keyword():
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        assert tensor_ops.average_op(None, False) == hvd.Sum
    assert tensor_ops.average_op(None, None) == hvd.Average
    with pytest.raises(ValueError, match="supersedes average"):
        tensor_ops.average_op(hvd.Sum, True)


def test_a_mismatch_message_names_both_ranks_values():
    mine = (("op", "Sum"), ("tensors", (((3,), "float32", "cpu"), ((4,), "int32", "cpu"))))
    theirs = (("op", "Sum"), ("tensors", (((3,), "float32", "cpu"), ((5,), "int32", "cpu"))))
    label, a, b = matching._difference(mine, theirs)
    assert (label, a, b) == ("as tensor 1 ", "a int32 tensor of shape [4] on cpu", "a int32 tensor of shape [5] on cpu")
    assert matching._difference((("root_rank", 1),), (("root_rank", 0),)) == ("root_rank ", "1", "0")
    assert matching._difference(mine, mine) is None


def test_alltoall_splits_are_checked_as_horovod_does():
    rows = torch.zeros(6, 2)
    assert tensor_ops._splits(rows, None, 3) == [2, 2, 2]
    assert tensor_ops._splits(rows, [1, 0, 5], 3) == [1, 0, 5]
    for splits, match in ((None, "equally"), (torch.ones(3), "32-bit"), ([7, 0, 0], "exceeds"), ([1, 1], "hold 3")):
        with pytest.raises(ValueError, match=match):
            tensor_ops._splits(rows if splits is not None else torch.zeros(5, 2), splits, 3)


def test_distributed_optimizer_names_as_horovod():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    names = distributed_optimizer._named(opt, None)
    assert [n for n, _ in names] == ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.0.2",
                                     "allreduce.noname.0.3"]
    with pytest.raises(ValueError, match="must be unique. Found duplicates: bias, weight"):
        distributed_optimizer._named(opt, [*a.named_parameters(), *b.named_parameters()])
    with pytest.raises(ValueError, match="one or more model parameters were not named"):
        distributed_optimizer._named(opt, a.named_parameters())
    with pytest.raises(ValueError, match="sequence of tuples"):
        distributed_optimizer._named(opt, [["weight", a.weight]])
    with pytest.raises(ValueError, match="only appear once"):
        distributed_optimizer._check_groups([[a.weight], [a.weight]])
    with pytest.raises(ValueError, match="op != Average"):
        distributed_optimizer._check(opt, None, 1, hvd.Sum, 2.0, None)
    with pytest.raises(ValueError, match="must be > 0"):
        distributed_optimizer._check(opt, None, 0, hvd.Average, 1.0, None)


def test_what_is_not_covered_raises_not_implemented_naming_what_to_use():
    with pytest.raises(NotImplementedError, match="average_buffers"):
        hvd.SyncBatchNorm(4)
    with pytest.raises(NotImplementedError, match="torch.profiler"):
        hvd.start_timeline("/tmp/timeline.json")
    with pytest.raises(NotImplementedError, match="elastic"):
        hvd.elastic  # noqa: B018 - the attribute access is what raises
    with pytest.raises(AttributeError):
        hvd.no_such_name  # noqa: B018
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()


def test_the_op_codes_are_horovods():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hvd.is_initialized() and hvd.mpi_built() and not hvd.nccl_built() and not hvd.gloo_built()
