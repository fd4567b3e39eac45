"""``python -m hsgd.run``: the supervisor that restarts a training job on the hosts that are left."""
