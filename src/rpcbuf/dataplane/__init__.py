"""rpcbuf's data plane: arenas, allocators, UCX transfers, checksums, same-host copies."""
