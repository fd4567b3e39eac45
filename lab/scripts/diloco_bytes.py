"""Inter-node bytes of sync and DiLoCo (fp32, int8, int4) on the diloco bench's gpt, 4 ranks as
2 nodes, 128 steps (the loss is not the point: random tokens)::

    mpiexec -n 4 python lab/scripts/diloco_bytes.py
"""
import torch
from mpi4py import MPI

from hsgd import HierarchicalDiLoCo, HierarchicalSGD, Topology
from hsgd._trainer.gpt import GPT, GPTConfig

comm = MPI.COMM_WORLD
topo = Topology.from_comm(comm, ranks_per_node=2)
out = {}
for name, kw in [("sync", None), ("diloco fp32", "none"), ("diloco int8", "int8"), ("diloco int4", "int4")]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = HierarchicalSGD(inner, model, topology=topo) if kw is None else \
        HierarchicalDiLoCo(inner, model, topology=topo, intra_period=1, inter_period=64, outer_compression=kw)
    gen = torch.Generator().manual_seed(comm.rank)
    for _ in range(128):
        x = torch.randint(0, 256, (2, 32), generator=gen)
        opt.zero_grad()
        logits = model(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        opt.step()
    out[name] = comm.allreduce(opt.traffic["inter_bytes"])
    opt.close()
if comm.rank == 0:
    params = sum(p.numel() for p in model.parameters())
    print(f"gpt 2x64 ({params} parameters), 4 ranks as 2 nodes, 128 steps, DiLoCo H=64 (2 outer rounds); "
          "inter-node bytes, all ranks")
    print("| run | inter-node bytes | vs DiLoCo fp32 | vs sync |")
    print("|---|---|---|---|")
    for k, v in out.items():
        print(f"| {k} | {v} | {out['diloco fp32'] / v:.2f}x fewer | {out['sync'] / v:.1f}x fewer |")
topo.close()
