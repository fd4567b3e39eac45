"""compression='fp16'/'bf16': the inter-node sums in 16 bits, inter-node bytes halved."""

import pytest
import torch
from _models import fixed_batch, hosts, mlp, shard

from hsgd import HierarchicalLocalSGD, HierarchicalSGD, InputValueError, Topology

# the relative precision of one 16-bit value
EPS = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def close_to_16_bits(got, exact, codec, parties):
    """Each of ``parties`` 16-bit roundings (a cast and the sums) errs by at most EPS of the
    largest partial sum; a wrong scale or a dropped node errs by the size of the values."""
    bound = 2 * parties * EPS[codec] * exact.abs().max().item()
    return (got - exact).abs().max().item() <= bound


def halved(small, plain):
    """Half the inter-node bytes, up to the rounding of 2 (p - 1) n / p per allreduce."""
    return abs(2 * small["inter_bytes"] - plain["inter_bytes"]) <= 2 * 8


def one_step(comm, compression, inter_node, ranks_per_node, mode=HierarchicalSGD, device="cpu", **kw):
    """One averaged step of float32 gradients on ``device``; returns (averaged gradients, traffic)."""
    topo = Topology.from_comm(comm, ranks_per_node=ranks_per_node)
    model = mlp(torch.float32, device=device)
    opt = mode(torch.optim.SGD(model.parameters(), lr=0.0), model, topology=topo,
               inter_node=inter_node, compression=compression, **kw)
    x, y = fixed_batch(torch.float32, device=device)
    rank, size = comm.Get_rank(), comm.Get_size()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(shard(x, rank, size)), shard(y, rank, size))
    (loss * (rank + 1)).backward()  # ranks' gradients differ in scale
    if mode is HierarchicalSGD:
        opt.synchronize()
        got = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
    else:
        for p in model.parameters():  # local SGD averages parameters: average the gradients' values
            p.data.copy_(p.grad)
        opt.step()
        got = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    traffic = {key: comm.allreduce(value) for key, value in opt.traffic.items()}  # all ranks' bytes
    opt.close()
    topo.close()
    return got, traffic


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("inter_node", ["leader", "sharded"])
def test_compressed_average_matches_the_exact_one_and_halves_inter_node_bytes(comm, codec, inter_node, device):
    size = comm.Get_size()
    rpn = max(1, size // 2)  # two or more virtual nodes from 2 ranks on
    exact, plain = one_step(comm, None, inter_node, rpn, device=device)
    got, small = one_step(comm, codec, inter_node, rpn, device=device)
    assert got.device.type == exact.device.type == device.type
    assert close_to_16_bits(got, exact, codec, size), (got - exact).abs().max()
    if size == 1:
        assert torch.equal(got, exact) and small["inter_bytes"] == plain["inter_bytes"] == 0
        return
    assert not torch.equal(got, exact)  # it did cross in 16 bits
    assert halved(small, plain) and plain["inter_bytes"] > 0, (small, plain)
    assert small["intra_bytes"] == plain["intra_bytes"]  # inside a node nothing changes
    every = comm.allgather(got)
    assert all(torch.equal(g, every[0]) for g in every)  # the same result on every rank


@pytest.mark.parametrize("inter_node", ["leader", "sharded"])
def test_overlap_compresses_each_bucket_in_the_background(comm, inter_node, device):
    """overlap=True: every bucket's inter-node sums run as non-blocking 16-bit allreduces
    during backward; the result is the exact average to 16 bits, at half the bytes."""
    size = comm.Get_size()
    rpn = max(1, size // 2)
    kw = {"overlap": True, "bucket_cap_mb": 1e-6, "device": device}  # every tensor its own bucket
    exact, plain = one_step(comm, None, inter_node, rpn, **kw)
    got, small = one_step(comm, "fp16", inter_node, rpn, **kw)
    assert close_to_16_bits(got, exact, "fp16", size), (got - exact).abs().max()
    if size > 1:
        assert not torch.equal(got, exact) and halved(small, plain) and plain["inter_bytes"] > 0, (small, plain)
    every = comm.allgather(got)
    assert all(torch.equal(g, every[0]) for g in every)


def test_local_sgd_compresses_its_global_averages(comm, device):
    size = comm.Get_size()
    exact, plain = one_step(comm, None, "leader", 1, HierarchicalLocalSGD, device=device)
    got, small = one_step(comm, "bf16", "leader", 1, HierarchicalLocalSGD, device=device)
    assert close_to_16_bits(got, exact, "bf16", size)
    assert halved(small, plain) and (size == 1) == (plain["inter_bytes"] == 0), (small, plain)


def test_only_what_crosses_hosts_is_compressed_and_bad_values_are_refused(comm):
    """Without virtual nodes the nodes are the hosts: on one host nothing crosses nodes and
    nothing is rounded; across hosts (tests/hosts) the hosts' sums cross in 16 bits."""
    exact, plain = one_step(comm, None, "leader", None)
    got, small = one_step(comm, "fp16", "leader", None)
    if len(hosts(comm)) == 1:
        assert torch.equal(got, exact) and plain["inter_bytes"] == small["inter_bytes"] == 0
    else:
        assert close_to_16_bits(got, exact, "fp16", comm.size) and not torch.equal(got, exact)
        assert halved(small, plain) and plain["inter_bytes"] > 0, (small, plain)
    model = mlp(torch.float32)
    with pytest.raises(InputValueError, match="compression"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, compression="zstd")
