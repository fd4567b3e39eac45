"""Concurrent TCP streams through the emulated hosts' shaped links, blocking vs polite waits.

The figures in docs/benchmarks.md ("What the cells that miss are made of") come from this
script, run across emulated hosts (root):

    python -m lab.hosts run --hosts 2 --ranks-per-host 2 --link 1gbit -- \
        python lab/scripts/concurrent_streams.py 16e6 9 shift
    python -m lab.hosts run --hosts 3 --ranks-per-host 1 --link 100mbit -- \
        python lab/scripts/concurrent_streams.py 1.33e6 9 fan
    python -m lab.hosts run --hosts 2 --ranks-per-host 2 --link 1gbit -- \
        python lab/scripts/concurrent_streams.py 16e6 15 header

Arguments: BYTES (per stream), REPEATS (timed, after one untimed), MODE:

- ``shift``: rank r (host h, local rank l) exchanges BYTES with the rank of local rank l on
  host h+1 (and from h-1) by a blocking ``Sendrecv``: k streams each way on every link;
- ``fan``: every rank sends BYTES to its counterpart on every other host at once
  (``Isend``/``Irecv``, ``Waitall``): k (N-1) streams each way on every link;
- ``shiftp``, ``fanp``: the same, completed by ``Testall`` and 200 us sleeps instead of a
  blocking wait (the ranks leave the cores to the TCP stack and to each other);
- ``fans``: ``fan`` with every send started before any receive, hsgd's polite wait (what
  ``python -m lab.bench model --hosts N`` times for the model's ``eta``);
- ``header``: the ``shift`` pairs in gossip's round before 2026-11-24 (h): a 16-byte header
  each way first, the model's receive posted once the header is in (hsgd's polite wait);
- ``framed``: the same pairs in gossip's round since: one message, the header in front of
  the model, the send started before the receive (hsgd's polite wait); ``framedr``: the
  receive first.

Prints every repeat's slowest-rank time, the median, and each host's TCP counters (its network
namespace's retransmissions and timeouts, from /proc/self/net).
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from hsgd._core.waits import wait_all

comm = MPI.COMM_WORLD
node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
k = node.size
N, h, local = comm.size // k, comm.rank // k, comm.rank % k
S = int(float(sys.argv[1]))
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
mode = sys.argv[3] if len(sys.argv) > 3 else "shift"
send = np.ones(S + 16, np.uint8)  # framed: 16 bytes of header, then the model
recv = [np.empty(S + 16, np.uint8) for _ in range(max(1, N - 1))]
model, head = send[16:], send[:16]


def peer(d):
    return ((h + d) % N) * k + local, ((h - d) % N) * k + local


def start(distances):
    requests = []
    for i, d in enumerate(distances):
        to, fro = peer(d)
        requests += [comm.Isend(model, to, d), comm.Irecv(recv[i][16:], fro, d)]
    return requests


def polite(requests):
    while not MPI.Request.Testall(requests):
        time.sleep(200e-6)


def run():
    if mode == "shift":
        to, fro = peer(1)
        comm.Sendrecv(model, to, 0, recv[0][16:], fro, 0)
    elif mode == "shiftp":
        polite(start([1]))
    elif mode == "header":
        to, fro = peer(1)
        requests = [comm.Irecv(recv[0][:16], fro, 1), comm.Isend(head, to, 1), comm.Isend(model, to, 2)]
        wait_all(requests[:1])
        wait_all(requests + [comm.Irecv(recv[0][16:], fro, 2)])
    elif mode == "framed":
        to, fro = peer(1)
        wait_all([comm.Isend(send, to, 1), comm.Irecv(recv[0], fro, 1)])
    elif mode == "framedr":
        to, fro = peer(1)
        wait_all([comm.Irecv(recv[0], fro, 1), comm.Isend(send, to, 1)])
    elif mode == "fan":
        MPI.Request.Waitall(start(range(1, N)))
    elif mode == "fans":
        outs = [comm.Isend(model, peer(d)[0], d) for d in range(1, N)]
        wait_all(outs + [comm.Irecv(recv[d - 1][16:], peer(d)[1], d) for d in range(1, N)])
    elif mode == "fanp":
        polite(start(range(1, N)))
    else:
        raise SystemExit(f"unknown mode {mode!r}: shift, shiftp, fan, fanp, fans, header, framed or framedr")


def tcp_counters():
    out = {}
    for path in ("/proc/self/net/snmp", "/proc/self/net/netstat"):
        lines = open(path).read().split("\n")
        for names, values in zip(lines[::2], lines[1::2]):
            prefix = names.split()[0]
            out.update({prefix + n: int(v) for n, v in zip(names.split()[1:], values.split()[1:])})
    return out


times = []
for i in range(reps + 1):
    comm.Barrier()
    t = time.perf_counter()
    run()
    dt = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
    if i:
        times.append(dt)
wanted = ["Tcp:RetransSegs", "TcpExt:TCPTimeouts", "TcpExt:TCPFastRetrans", "Tcp:OutSegs"]
counters = tcp_counters() if local == 0 else None
counters = comm.gather({w: counters.get(w) for w in wanted} if counters else None, root=0)
if comm.rank == 0:
    streams = k * ((N - 1) if mode.startswith("fan") else 1)
    print("every repeat, ms:", " ".join(f"{t * 1e3:.0f}" for t in times))
    print(f"{mode}: {N} hosts x {k} ranks, {S / 1e6:.2f} MB per stream, {streams} streams each way per link, "
          f"{streams * S / 1e6:.2f} MB per link: median {np.median(times) * 1e3:.1f} ms, "
          f"min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}")
    for rank, c in enumerate(counters):
        if c:
            print(f"host of rank {rank}: {c}")
