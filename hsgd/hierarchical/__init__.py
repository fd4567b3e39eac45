"""The hierarchical family: two-level averaging over a node's shared memory
and across nodes (synchronous SGD and hierarchical local SGD)."""
