"""rpcbuf as SGLang's HiCache storage backend, ``RpcbufHiCacheStorage``, loaded
by SGLang's ``dynamic`` backend (configuration in docs/kvcache.md).  An optional
extra: only this package imports SGLang.  A daemon that is gone is a miss,
never an exception into the scheduler; a refused token is ``TokenRefused`` at
start.
"""

from __future__ import annotations

from ._storage import RpcbufHiCacheStorage, TokenRefused

__all__ = ["RpcbufHiCacheStorage", "TokenRefused"]
