"""rpcbuf's control plane: ``wire`` (shared, sans-I/O), ``daemon``, ``client``, ``cli``."""
