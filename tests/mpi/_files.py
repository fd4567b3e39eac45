"""Files the MPI tests share: rank 0 writes, every rank reads (with the ``shared_dir`` fixture)."""

import h5py
import numpy as np
from mpi4py import MPI


def write_on_root(path, **datasets):
    """Rank 0 writes ``datasets``; returns on every rank once the file is complete."""
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        with h5py.File(path, "w") as f:
            for name, data in datasets.items():
                f.create_dataset(name, data=data, chunks=(7, *np.shape(data)[1:]))
    comm.Barrier()  # the file is complete before anyone opens it
    return path
