"""rpcbuf as SGLang's HiCache storage backend: ``RpcbufHiCacheStorage``, a
``HiCacheStorage`` over rpcbuf's keyed block tier (docs/kvcache.md, "rpcbuf
as SGLang's HiCache backend").

An optional extra (``pip install 'rpcbuf[sglang]'``): this package imports
SGLang, which rpcbuf itself never does.  SGLang loads it by module path,
configuration only (its ``dynamic`` storage backend)::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{
            "backend_name": "rpcbuf", "module_path": "rpcbuf_sglang",
            "class_name": "RpcbufHiCacheStorage", "interface_v1": 1,
            "endpoints": "h1:7700;h2:7700", "token": "..."}'

``interface_v1`` makes SGLang call the zero-copy forms (pages read into
and written from its host KV pool in place); ``endpoints`` is one node, a
list, or the fleet registry ("etcd://h:2379"); ``ttl``, ``timeout``,
``replicas``, ``cluster``, ``same_host`` and ``namespace`` are optional.
A daemon that is gone is a miss, never an exception into the scheduler; a
refused token is ``TokenRefused`` at start.
"""

from __future__ import annotations

from ._storage import RpcbufHiCacheStorage, TokenRefused

__all__ = ["RpcbufHiCacheStorage", "TokenRefused"]
