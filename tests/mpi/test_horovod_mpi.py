"""hsgd.horovod under mpiexec, at every world size, against references computed on each rank.

Every rank builds every rank's inputs from a seed (``_inputs``), so the expected result of a
collective is computed locally in float64 and compared with what the ranks got together.
"""

import pytest
import torch
from mpi4py import MPI

import hsgd
import hsgd.horovod as hvd


@pytest.fixture(scope="module", autouse=True)
def _horovod():
    """hvd.init() for this module's tests, hvd.shutdown() after them (both collective)."""
    hvd.init()
    yield
    hvd.shutdown()


def _inputs(rank, shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-6, 7, shape, generator=gen).to(dtype)  # a product of 5 ranks' values fits float16


def _all_inputs(size, shape, dtype, seed=0):
    return torch.stack([_inputs(r, shape, dtype, seed).to(torch.float64) for r in range(size)])


def still_in_step():
    """After an error every rank must still be at the same collective."""
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == hvd.size()


def test_status_queries_describe_the_world_and_its_nodes(comm):
    assert (hvd.rank(), hvd.size(), hvd.is_initialized()) == (comm.Get_rank(), comm.Get_size(), True)
    with hsgd.Topology.from_comm(comm) as topo:
        assert (hvd.local_rank(), hvd.local_size()) == (topo.local_rank, topo.local_size)
        assert (hvd.cross_rank(), hvd.cross_size()) == (topo.node_index, topo.num_nodes)
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    assert hvd.mpi_enabled() and not hvd.gloo_enabled() and not hvd.cuda_built()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.int32, torch.int64])
def test_allreduce_every_op_with_factors_against_float64(dtype):
    size, rank = hvd.size(), hvd.rank()
    every = _all_inputs(size, (3, 5), dtype)
    mine = _inputs(rank, (3, 5), dtype)
    integer = not dtype.is_floating_point

    def cast(x):  # Horovod's cast of a scaled value: integers truncate toward zero
        return x.trunc() if integer else x
    pre, post = 0.75, 1.5
    want = {hvd.Sum: every.sum(0), hvd.Min: every.min(0).values, hvd.Max: every.max(0).values,
            hvd.Product: every.prod(0), hvd.Average: cast(every.sum(0) * (1.0 / size))}
    for op, expected in want.items():
        got = hvd.allreduce(mine, op=op)
        assert got.dtype == dtype and torch.allclose(got.double(), expected, rtol=1e-3), (op, got, expected)
    scaled = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=pre, postscale_factor=post)
    expected = cast(cast(every * pre).sum(0) * post)
    assert torch.allclose(scaled.double(), expected, rtol=1e-3, atol=1e-2), (scaled, expected)
    assert torch.equal(mine, _inputs(rank, (3, 5), dtype))  # the input is untouched


def test_an_integer_average_rounds_toward_zero():
    size, rank = hvd.size(), hvd.rank()
    mine = torch.tensor([-1, 1, 2 * rank + 1], dtype=torch.int64) * (1 if rank == 0 else 0)
    got = hvd.allreduce(mine, op=hvd.Average)
    want = [int(v / size) for v in ([-1, 1, 1])]  # only rank 0 contributes
    assert got.tolist() == want, got


def test_in_place_and_grouped_forms_and_the_deprecated_average_keyword():
    size, rank = hvd.size(), hvd.rank()
    a, b = torch.full((4,), float(rank)), torch.full((2, 2), rank, dtype=torch.int64)
    assert hvd.allreduce_(a, op=hvd.Sum) is a and torch.equal(a, torch.full((4,), size * (size - 1) / 2))
    x, y = torch.full((3,), float(rank)), torch.full((2,), float(rank))
    with pytest.warns(DeprecationWarning):
        got = hvd.grouped_allreduce([x, y], average=False)
    assert [g.tolist() for g in got] == [[size * (size - 1) / 2] * 3, [size * (size - 1) / 2] * 2]
    hvd.grouped_allreduce_([b], op=hvd.Max)
    assert torch.equal(b, torch.full((2, 2), size - 1))


def test_allgather_rows_differ_by_rank_and_grouped():
    size, rank = hvd.size(), hvd.rank()
    mine = torch.full((rank + 1, 2), rank, dtype=torch.int16)
    want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int16) for r in range(size)])
    assert torch.equal(hvd.allgather(mine), want)
    got = hvd.grouped_allgather([mine, mine.float()])
    assert torch.equal(got[0], want) and torch.equal(got[1], want.float())


def test_broadcast_and_alltoall_with_uneven_splits():
    size, rank = hvd.size(), hvd.rank()
    got = hvd.broadcast(torch.full((3,), float(rank)), size - 1)
    assert torch.equal(got, torch.full((3,), float(size - 1)))
    splits = [(rank + d) % 3 for d in range(size)]  # rank r sends (r + d) % 3 rows to rank d
    rows = torch.cat([torch.full((s, 2), 100 * rank + d, dtype=torch.float64) for d, s in enumerate(splits)])
    out, received = hvd.alltoall(rows, splits=torch.tensor(splits, dtype=torch.int32))
    want = torch.cat([torch.full(((r + rank) % 3, 2), 100 * r + rank, dtype=torch.float64) for r in range(size)])
    assert torch.equal(out, want) and received.tolist() == [(r + rank) % 3 for r in range(size)]


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gives_the_first_ranks_the_remainder(op):
    size, rank = hvd.size(), hvd.rank()
    every = _all_inputs(size, (2 * size + 1, 3), torch.float64)
    total = every.sum(0) / (size if op == "Average" else 1)
    got = hvd.reducescatter(_inputs(rank, (2 * size + 1, 3), torch.float64), op=getattr(hvd, op))
    start = sum(hsgd.horovod.execution.reduced_rows(2 * size + 1, size, r) for r in range(rank))
    assert torch.allclose(got, total[start:start + got.shape[0]]) and got.shape[0] == 2 + (rank == 0)


def test_named_operations_match_whatever_order_each_rank_submits_them():
    size, rank = hvd.size(), hvd.rank()
    names = ["a", "b", "c", "d"]
    order = names if rank % 2 == 0 else names[::-1]
    handles = {n: hvd.allreduce_async(torch.full((2,), float(rank + i)), name=n, op=hvd.Sum)
               for i, n in ((names.index(n), n) for n in order)}
    gather = hvd.allgather_async(torch.tensor([rank]), name="a")  # another kind: its own name space
    for i, n in enumerate(names):
        assert hvd.synchronize(handles[n]).tolist() == [size * (size - 1) / 2 + size * i] * 2
    assert hvd.synchronize(gather).tolist() == list(range(size))
    assert hvd.poll(hvd.allreduce_async(torch.ones(1), name="polled")) in (True, False)


def test_mismatched_tensors_and_roots_raise_on_every_rank():
    size, rank = hvd.size(), hvd.rank()
    if size == 1:
        pytest.skip("one rank: nothing to mismatch")
    cases = [lambda: hvd.allreduce(torch.zeros(3 + (rank == 1))),
             lambda: hvd.allreduce(torch.zeros(3, dtype=torch.float32 if rank else torch.float64)),
             lambda: hvd.broadcast(torch.zeros(2), root_rank=rank),
             lambda: hvd.allgather(torch.zeros(2, 1 + (rank == size - 1)))]
    for case in cases:
        with pytest.raises(hvd.HorovodInternalError, match="every rank must pass the same"):
            case()
        still_in_step()
    # refused on one rank only: that rank raises its own error, the others the same message
    error = ValueError if rank == 0 else hvd.HorovodInternalError
    with pytest.raises(error, match="32-bit integers"):
        hvd.alltoall(torch.zeros(size), splits=torch.ones(size, dtype=torch.int64 if rank == 0 else torch.int32))
    still_in_step()
    # a name in flight on this rank is refused: rank 0 submits twice before any other rank
    # submits once, so its first cannot have completed (on a rank that submits last, the first
    # may complete inside its own submit)
    if rank:
        MPI.COMM_WORLD.Barrier()
    handle = hvd.allreduce_async(torch.ones(1), name="twice")
    if rank == 0:
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(1), name="twice")
        MPI.COMM_WORLD.Barrier()
    hvd.synchronize(handle)
    still_in_step()


def test_join_contributes_zeros_to_allreduce_and_to_a_distributed_optimizer_step():
    size, rank = hvd.size(), hvd.rank()
    joiner = size - 1
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    if rank == joiner:
        last = hvd.join()
    else:
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size - 1.0] * 2
        assert torch.allclose(hvd.allreduce(torch.ones(2), op=hvd.Average), torch.full((2,), (size - 1) / size))
        with pytest.raises(hvd.HorovodInternalError, match="not supported with join"):
            hvd.allgather(torch.ones(1))
        opt.zero_grad()
        model(torch.full((1, 3), float(rank + 1))).sum().backward()  # gradient: rank + 1, per weight
        opt.step()
        mean = sum(r + 1 for r in range(size) if r != joiner) / size  # the joined rank counts as zero
        assert torch.allclose(model.weight.detach(), torch.full((1, 3), 1.0 - mean)), model.weight
        if rank == size - 2:  # joins last: this allreduce completes only once every other rank joined
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [1.0]
        last = hvd.join()
    assert last == (joiner if size == 1 else size - 2)
    assert hvd.allgather_object(last) == [last] * size
    opt.close()
    still_in_step()


def test_a_joined_rank_follows_the_steps_of_every_optimizer_it_is_in():
    """The last rank joins; the others step an optimizer over a process set without rank 0 (the
    joined rank a member), then one over the world, twice: the joined rank takes part in both
    with zero gradients, each average dividing by its own set's size."""
    size, rank = hvd.size(), hvd.rank()
    if size < 3:  # a process set of two or more ranks, rank 0 not among them
        return
    joiner, members = size - 1, list(range(1, size))
    subset = hvd.add_process_set(members)
    models = [torch.nn.Linear(3, 1, bias=False, dtype=torch.float64) for _ in range(2)]
    for model in models:
        torch.nn.init.constant_(model.weight, 1.0)
    opts = [hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), process_set=ps,
                                     named_parameters=model.named_parameters())
            for model, ps in zip(models, (subset, hvd.global_process_set))]
    if rank == joiner:
        hvd.join()
    else:
        for _ in range(2):
            for model, opt, ps in zip(models, opts, (subset, hvd.global_process_set)):
                if rank in ps.ranks:
                    opt.zero_grad()
                    model(torch.full((1, 3), float(rank + 1), dtype=torch.float64)).sum().backward()
                    opt.step()
        hvd.join()
    # float64 reference: per step, the stepping members' gradients (rank + 1) over the set's size
    for model, ranks in zip(models, (members, list(range(size)))):
        if rank not in ranks or rank == joiner:  # a joined rank averages, but does not step
            continue
        mean = sum(r + 1 for r in ranks if r != joiner) / len(ranks)
        assert torch.allclose(model.weight.detach(), torch.full((1, 3), 1.0 - 2 * mean, dtype=torch.float64))
    for opt in opts:
        opt.close()
    hvd.remove_process_set(subset)
    still_in_step()


def test_process_sets_are_communicators_added_and_removed_on_every_rank():
    size, rank = hvd.size(), hvd.rank()
    if size == 1:  # the set of rank 0 is the global set
        with pytest.raises(ValueError, match="duplicate process set"):
            hvd.add_process_set([0])
        return
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    assert evens.included() == (rank % 2 == 0) and evens.size() == (size + 1) // 2
    if rank % 2 == 0:
        assert evens.rank() == rank // 2
        got = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=evens)
        assert got.item() == sum(range(0, size, 2))
        last = 2 * ((size - 1) // 2)
        assert hvd.broadcast(torch.tensor([rank]), root_rank=last, process_set=evens).item() == last
        assert hvd.broadcast_object({"from": rank}, root_rank=last, process_set=evens) == {"from": last}
    else:
        with pytest.raises(ValueError, match="not a member"):
            hvd.allreduce(torch.ones(1), process_set=evens)
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    with pytest.raises(ValueError, match="different process sets"):
        hvd.add_process_set([rank])
    assert hvd.remove_process_set(evens) and evens.process_set_id is None
    assert not hvd.remove_process_set(hvd.global_process_set)
    still_in_step()


def _train(wrap, steps=3, passes=1):
    """A small model trained on each rank's own batches; its weights after ``steps`` steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    for step in range(steps):
        opt.zero_grad()
        for p in range(passes):
            x = _inputs(hvd.rank(), (5, 4), torch.float64, seed=1 + 10 * step + p) / 50
            model(x).pow(2).sum().backward()
        opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    if hasattr(opt, "close"):
        opt.close()
    return weights


def test_distributed_optimizer_takes_hierarchical_sgds_steps():
    size = hvd.size()
    reference = _train(lambda o, m: hsgd.HierarchicalSGD(o, m, backward_passes_per_step=2), passes=2)
    horovod = _train(lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                           backward_passes_per_step=2), passes=2)
    assert all(torch.equal(a, b) for a, b in zip(reference, horovod))
    predivided = _train(lambda o, m: hvd.DistributedOptimizer(o, gradient_predivide_factor=4.0), passes=1)
    averaged = _train(lambda o, m: hsgd.HierarchicalSGD(o, m), passes=1)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(predivided, averaged))
    summed = _train(lambda o, m: hvd.DistributedOptimizer(o, op=hvd.Sum), steps=1)
    big_lr = _train(lambda o, m: hsgd.HierarchicalSGD(
        torch.optim.SGD(m.parameters(), lr=0.1 * size, momentum=0.9), m), steps=1)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(summed, big_lr))


def test_distributed_optimizer_horovods_protocol_and_errors():
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # zero gradients, as Horovod
    assert set(opt._parameter_names.values()) == {"weight", "bias"}
    model(torch.ones(1, 2) * (hvd.rank() + 1)).sum().backward()
    opt.synchronize()
    assert model.weight.grad.tolist() == [[(hvd.size() + 1) / 2] * 2]
    with pytest.warns(UserWarning, match="without optimizer.skip_synchronize"):
        opt.step()
    opt.close()
    with pytest.raises(ValueError, match="Found duplicates"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", model.weight), ("w", model.bias)])
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    still_in_step()


def test_sparse_gradients_are_averaged_and_handed_back_sparse():
    size, rank = hvd.size(), hvd.rank()
    for as_dense in (False, True):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(6, 2, sparse=True)
        start = embedding.weight.detach().clone()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=1.0), sparse_as_dense=as_dense)
        opt.zero_grad()
        embedding(torch.tensor([rank % 6, 5])).sum().backward()
        opt.step()
        counts = torch.zeros(6)
        for r in range(size):
            counts[r % 6] += 1
        counts[5] += size
        assert embedding.weight.grad.is_sparse
        assert torch.allclose(embedding.weight.detach(), start - (counts / size)[:, None])
        opt.close()


def test_state_helpers_copy_from_the_root():
    size, rank = hvd.size(), hvd.rank()
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=size - 1)
    assert torch.equal(model.weight, torch.full((2, 2), float(size - 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1))
    if rank == 0:
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1 and len(opt.state) == 2
    assert hvd.allgather_object({"r": rank}) == [{"r": r} for r in range(size)]
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)
    still_in_step()


def test_gradients_of_the_collectives_are_horovods():
    size, rank = hvd.size(), hvd.rank()
    x = torch.full((2 * size, 2), float(rank), requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, size))
    x.grad = None
    hvd.allgather(x).sum().backward()  # the averaged gradient's own rows
    assert torch.equal(x.grad, torch.ones_like(x))
    x.grad = None
    hvd.broadcast(x, root_rank=0).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 1.0 if rank == 0 else 0.0))
    x.grad = None
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()  # Horovod's: times the set size
    assert torch.equal(x.grad, torch.full_like(x, size))
    x.grad = None
    hvd.alltoall(x).mul(2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
