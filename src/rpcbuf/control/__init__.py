"""rpcbuf's control plane: ``wire`` (shared, sans-I/O), ``daemon``, ``client``, ``cli``,
``fleet`` (the registry's I/O) and ``ucx_errors`` (UCX's failures as rpcbuf's errors)."""
