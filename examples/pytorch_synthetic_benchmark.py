"""Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``, written for hsgd.

Synthetic data, a fixed model, timed training steps; rank 0 prints samples
per second per rank and in total, with a 95 % interval over iterations::

    mpiexec -n 4 python examples/pytorch_synthetic_benchmark.py
    mpiexec -n 4 python examples/pytorch_synthetic_benchmark.py --model cnn --batch-size 64
    HSGD_RANKS_PER_NODE=2 mpiexec -n 4 python examples/pytorch_synthetic_benchmark.py --compression bf16
    mpiexec -n 2 python examples/pytorch_synthetic_benchmark.py --device cuda

Horovod's default is ResNet-50 on ImageNet-sized images from torchvision;
hsgd's examples depend on torch only, so the models are an MLP (``mlp``,
8.4M parameters at the default width: a communication-bound step) and
the MNIST-1D CNN (``cnn``, 5.2k parameters: compute-bound). The figures
depend on the machine; docs/benchmarks.md compares hsgd with torch DDP side
by side.

``--device cuda`` runs on the GPUs, rank ``i`` of a host on its GPU ``i % count``
(ranks share GPUs when there are fewer GPUs than ranks), each timed block ending
with ``torch.cuda.synchronize()``; ``--device auto`` does so when every rank sees a
GPU. When some rank sees no GPU, ``--device cuda`` makes every rank exit with
status 2, rank 0 printing one line.
"""

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import hsgd


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="hsgd synthetic benchmark",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="model to benchmark")
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the mlp")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="warm-up batches, not timed")
    parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                        help="16-bit node sums across nodes (Horovod's --fp16-allreduce)")
    parser.add_argument("--inter-node", choices=["leader", "sharded"], default="leader",
                        help="who allreduces across nodes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                        help="cpu, cuda (rank i of a host on its GPU i %% count) or auto (cuda when every "
                             "rank sees a GPU)")
    return parser.parse_args(argv)


def build(args, device):
    if args.model == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(1024, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        data = torch.randn(args.batch_size, 1024)
    else:
        model = torch.nn.Sequential(torch.nn.Unflatten(1, (1, 40)),
                                    torch.nn.Conv1d(1, 25, 5, stride=2, padding=1), torch.nn.ReLU(),
                                    torch.nn.Conv1d(25, 25, 3, stride=2, padding=1), torch.nn.ReLU(),
                                    torch.nn.Conv1d(25, 25, 3, stride=2, padding=1), torch.nn.ReLU(),
                                    torch.nn.Flatten(), torch.nn.Linear(125, 10))
        data = torch.randn(args.batch_size, 40)
    target = torch.randint(0, 10, (args.batch_size,))
    return model.to(device), data.to(device), target.to(device)


def log(message):
    if hsgd.rank() == 0:
        print(message, flush=True)


def main(argv=None):
    args = parse_args(argv)
    try:
        device = hsgd.pick_device(args.device)  # hsgd: the same decision on every rank
    except hsgd.InputError as exc:  # --device cuda where some rank sees no GPU
        if hsgd.rank() == 0:
            print(f"pytorch_synthetic_benchmark.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model, data, target = build(args, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hsgd.size())
    optimizer = hsgd.HierarchicalSGD(optimizer, named_parameters=model.named_parameters(),
                                     compression=args.compression, inter_node=args.inter_node)

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def timed(steps):
        """Seconds of ``steps`` steps; on a GPU, after the queued kernels finish, at both ends."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            benchmark_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({params / 1e6:.2f}M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    log(f"Number of ranks: {hsgd.size()} ({hsgd.local_size()} on this node)")
    log("Running warmup...")
    timed(args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        seconds = timed(args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} samples/sec per rank")
        rates.append(rate)
    # per-rank rates vary by rank: average them (Horovod prints rank 0's)
    rates = hsgd.allreduce(torch.tensor(rates, dtype=torch.float64), op="mean").numpy()
    mean, conf = np.mean(rates), 1.96 * np.std(rates)
    log(f"Samples/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total samples/sec on {hsgd.size()} rank(s): {hsgd.size() * mean:.1f} +-{hsgd.size() * conf:.1f}")
    traffic = optimizer.traffic
    log(f"Bytes moved by rank 0: {traffic['intra_bytes'] / 1e6:.1f} MB inside its node, "
        f"{traffic['inter_bytes'] / 1e6:.1f} MB across nodes")
    optimizer.close()
    return mean


if __name__ == "__main__":
    main()
