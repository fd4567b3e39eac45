"""Private pieces of ``python -m hsgd.train``: configuration, model zoo,
building, evaluation, checkpoints, metrics and progress output."""
