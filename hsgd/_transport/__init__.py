"""Private pieces of the transport layer (beside :mod:`hsgd.topology`, :mod:`hsgd.intra_node`,
:mod:`hsgd.inter_node`, :mod:`hsgd.compression` and :mod:`hsgd.remote`)."""
