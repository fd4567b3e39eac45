"""Private pieces that every synchronization mode shares: error agreement,
argument checks, the binding of tensors to shared memory, the mode base class
and traffic counters."""
