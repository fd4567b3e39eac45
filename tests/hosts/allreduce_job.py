"""A job for tests/hosts: where each rank runs, and COUNT allreduces of NBYTES bytes.

``python allreduce_job.py COUNT NBYTES``: rank 0 prints one JSON line with every rank's host
name, the size of its ``MPI_COMM_TYPE_SHARED`` node and its network interfaces.
"""

import json
import os
import socket
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
count, nbytes = int(sys.argv[1]), int(sys.argv[2])
node = comm.Split_type(MPI.COMM_TYPE_SHARED)
me = {"host": socket.gethostname(), "node_size": node.Get_size(), "interfaces": sorted(os.listdir("/sys/class/net"))}
node.Free()
data = np.ones(nbytes // 4, dtype=np.float32)
out = np.empty_like(data)
for _ in range(count):
    comm.Allreduce(data, out)
    assert out[0] == comm.Get_size()
every = comm.gather(me)
if comm.Get_rank() == 0:
    print(json.dumps(every), flush=True)
