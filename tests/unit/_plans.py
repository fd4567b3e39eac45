"""What the read-plan tests compute from an :class:`~hsgd._io.plan.EpochPlan` through its
public methods."""


def batch_indices(plan):
    """``plan.indices()`` cut into batches of ``plan.batch_size`` (the last one may be short
    only with ``pad=False``)."""
    order = plan.indices()
    return [order[i:i + plan.batch_size] for i in range(0, len(order), plan.batch_size)]
