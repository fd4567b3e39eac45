"""hsgd._transport.sums: the in-place sums of level 2, blocking and in steps, at every party count.

At 3 ranks (and any count that is not a power of two) they go as a reduce-scatter then an
allgather; elsewhere as one allreduce. Either way every rank ends with the exact sums.
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hsgd._transport.sums import splits, start_sum, sum_
from hsgd.compression import Half, Part
from hsgd.intra_node import Layout

COMM = MPI.COMM_WORLD
# sizes below, at and above the party count, and uneven blocks
SIZES = [1, 2, 5, 64, 1001]


def values(n, dtype=np.float32):
    """Rank r's values: distinct per rank and element, small integers (exact in 16 bits too)."""
    return (np.arange(n) % 7 + 3 * COMM.rank + 1).astype(dtype)


def expected(n, dtype=np.float32):
    return sum((np.arange(n) % 7 + 3 * r + 1) for r in range(COMM.size)).astype(dtype)


def test_splits_exactly_where_allreduce_folds():
    p = COMM.size
    assert splits(COMM) == (p not in (1, 2, 4, 8, 16, 32, 64))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blocking_sum_is_the_exact_sum(n, dtype):
    array = values(n, dtype)
    sum_(COMM, array)
    np.testing.assert_array_equal(array, expected(n, dtype))


@pytest.mark.parametrize("n", SIZES)
def test_stepwise_sum_is_the_exact_sum(n):
    array = values(n)
    steps = start_sum(COMM, array)
    assert len(steps) == (2 if splits(COMM) else 1)
    for step in steps:
        step().Wait()
    np.testing.assert_array_equal(array, expected(n))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_16_bit_sums_blocking_and_in_steps(n, codec):
    layout = Layout([(torch.float32, n)])
    channel = Half(codec).open(COMM, layout, 4 << 20)
    try:
        stepped = torch.from_numpy(values(n))
        steps, sent = channel.steps(Part(0, 0, n, stepped))
        for step in steps:
            request, finish = step()
            request.Wait()
            if finish is not None:
                finish()
    finally:
        channel.close()
    exact = torch.from_numpy(expected(n))
    bound = 2 * COMM.size * 2.0 ** -8 * exact.abs().max().item()  # bf16's precision, the looser
    assert (stepped - exact).abs().max().item() <= bound
    assert sent == 2 * (COMM.size - 1) * 2 * n // COMM.size  # 16 bits a value, as the ring sends
