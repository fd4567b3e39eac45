"""Horovod's ``examples/pytorch/pytorch_mnist.py``, written for hsgd, on MNIST-1D.

The shape Horovod users know: parse arguments, scale the learning rate by
the number of ranks, wrap the optimizer, broadcast the initial state from
rank 0, train on this rank's shard, average the test metrics over ranks,
print on rank 0. The differences are the lines marked ``# hsgd``::

    mpiexec -n 4 python examples/pytorch_mnist1d.py
    mpiexec -n 4 python examples/pytorch_mnist1d.py --epochs 20 --compression bf16 --use-mixed-precision
    mpiexec -n 2 python examples/pytorch_mnist1d.py --device cuda --epochs 2 --use-mixed-precision

MNIST-1D (Greydanus 2020: 40-sample 1-D signals of the ten digits) is
generated offline the first time into ``--data-dir`` by rank 0 (about 20 s
for the default 40 000 samples); every rank then reads its shard of it in
large contiguous blocks (:class:`hsgd.ContiguousH5Loader`, the role of
torch's ``DistributedSampler`` in the Horovod example).

``--device cuda`` trains on the GPUs, rank ``i`` of a host on its GPU ``i % count``
(ranks share GPUs when there are fewer GPUs than ranks); ``--device auto`` does so
when every rank sees a GPU, else stays on the CPU. When some rank sees no GPU,
``--device cuda`` makes every rank exit with status 2, rank 0 printing one line.

``--use-mixed-precision`` autocasts to bf16 on the chosen device. On the CPU it
first tries bf16 autocast in a child process (once per host): on a CPU whose bf16
kernels crash (AMX advertised but not enabled) every rank exits with status 2 and
rank 0 prints one line saying what to set, instead of the job dying of SIGILL.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from mpi4py import MPI

import hsgd  # hsgd: instead of `import horovod.torch as hvd`
from hsgd.amp import check_autocast
from hsgd.data import ensure_mnist1d


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="hsgd MNIST-1D example")
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size per rank for training")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="input batch size for testing")
    parser.add_argument("--epochs", type=int, default=10, help="number of epochs to train")
    # Horovod's MNIST example uses 0.01 and 0.5; MNIST-1D's CNN learns faster with these
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (per rank; scaled by the ranks)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--seed", type=int, default=42, help="random seed")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between training log lines")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                        help="16-bit node sums across nodes (Horovod's --fp16-allreduce)")
    parser.add_argument("--use-mixed-precision", action="store_true",
                        help="autocast to bfloat16 with a GradScaler, as Horovod's example does with fp16")
    parser.add_argument("--samples", type=int, default=40000, help="MNIST-1D samples to generate (80%% train)")
    parser.add_argument("--data-dir", default="~/.cache/hsgd", help="where the generated data set is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu",
                        help="cpu, cuda (rank i of a host on its GPU i %% count) or auto (cuda when every "
                             "rank sees a GPU)")
    return parser.parse_args(argv)


class Net(torch.nn.Module):
    """The MNIST-1D paper's small CNN."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(1, 25, 5, stride=2, padding=1)
        self.conv2 = torch.nn.Conv1d(25, 25, 3, stride=2, padding=1)
        self.conv3 = torch.nn.Conv1d(25, 25, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(125, 10)

    def forward(self, x):
        x = x.unsqueeze(1)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.fc(x.flatten(1))


def train(epoch, model, optimizer, loader, scaler, device, args):
    model.train()
    loader.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.use_mixed_precision):
            loss = F.cross_entropy(model(data), target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # hsgd: averages, unscales, skips a non-finite step on every rank alike
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if batch_idx % args.log_interval == 0 and hsgd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(loader) * len(data)} on rank 0"
                  f" ({100.0 * batch_idx / len(loader):.0f}%)]\tLoss: {loss.item():.6f}")


def metric_average(value, name):
    return hsgd.allreduce(torch.tensor(value, dtype=torch.float64), op="sum").item()


def test(model, loader, device):
    model.eval()
    test_loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for data, target in loader:  # every test sample exactly once over all ranks
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += int((output.argmax(1) == target).sum())
            count += len(target)
    # hsgd: sums over ranks, then the means (ranks may hold one batch more or less)
    count = metric_average(count, "count")
    test_loss = metric_average(test_loss, "avg_loss") / count
    accuracy = metric_average(correct, "avg_accuracy") / count
    if hsgd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * accuracy:.2f}%\n")
    return accuracy


def fail(message):
    """Every rank exits with status 2; rank 0 says why, in one line."""
    if hsgd.rank() == 0:
        print(f"pytorch_mnist1d.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    args = parse_args(argv)
    try:
        # hsgd: the same decision on every rank (Horovod's torch.cuda.set_device(hvd.local_rank()))
        device = hsgd.pick_device(args.device)
    except hsgd.InputError as exc:  # --device cuda where some rank sees no GPU
        fail(exc)
    if args.use_mixed_precision:
        # hsgd: bf16 kernels kill the process on some CPUs; try them in a child process first
        # (every rank gets the same answer, so every rank exits alike; nothing to try on a GPU)
        problem = check_autocast(device.type, torch.bfloat16, off="drop --use-mixed-precision")
        if problem:
            fail(f"--use-mixed-precision: {problem}")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    # rank 0 generates the data set once; the others wait for it
    path = ensure_mnist1d(Path(args.data_dir).expanduser(), num_samples=args.samples, comm=MPI.COMM_WORLD)
    train_loader = hsgd.ContiguousH5Loader(path, "x_train", "y_train", batch_size=args.batch_size, seed=args.seed)
    test_loader = hsgd.ContiguousH5Loader(path, "x_test", "y_test", batch_size=args.test_batch_size,
                                          shuffle=False, drop_last=False, pad=False)
    model = Net().to(device)
    # Horovod: scale the learning rate by the number of workers
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hsgd.size(), momentum=args.momentum)
    # hsgd: the wrapper broadcasts the parameters from rank 0 when it is built; the explicit
    # broadcasts below are Horovod's lines and are harmless here
    optimizer = hsgd.HierarchicalSGD(optimizer, named_parameters=model.named_parameters(),
                                     compression=args.compression)
    hsgd.broadcast_parameters(model.state_dict(), root_rank=0)
    hsgd.broadcast_optimizer_state(optimizer, root_rank=0)
    scaler = torch.amp.GradScaler(device.type) if args.use_mixed_precision else None
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(epoch, model, optimizer, train_loader, scaler, device, args)
        accuracy = test(model, test_loader, device)
    optimizer.close()  # hsgd: collective, frees the shared window
    train_loader.close()
    test_loader.close()
    return accuracy


if __name__ == "__main__":
    main()
