"""Private pieces of the synchronization modes: the mode base class, the binding of tensors to
a slot, and the averaging of gradient buckets during backward."""
