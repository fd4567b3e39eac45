"""On the ``PYTHONPATH`` of a job (tests/e2e): rank 1 believes it has a GPU
(``torch.cuda.is_available()`` returns ``True`` there), the other ranks see none, as on a
cluster where one node lacks its GPU or its driver. Nothing on rank 1 goes further than
asking: ``--device cuda`` must make every rank agree that the job cannot use the GPUs.
Python imports this module at start-up, before the command runs.
"""

import os

rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
if rank == "1":
    import torch

    torch.cuda.is_available = lambda: True
