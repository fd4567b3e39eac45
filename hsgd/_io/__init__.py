"""Private pieces of :class:`hsgd.parallel_io.ContiguousH5Loader`: the read
plan, file checks, the direct reader, the prefetch thread and HDF5 writing."""
