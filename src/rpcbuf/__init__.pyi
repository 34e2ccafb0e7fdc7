"""The public API's names, for type checkers and for ``lazy_loader``, which
reads this file to import each name's module on first use (``__init__.py``)."""

from .control.client.cluster import Cluster, ClusterError
from .control.client.connect import Connector, connect, create_rpc_context
from .control.client.context import RpcContext
from .control.client.keyspace import BlockCluster
from .control.client.pool import BufferPool
from .control.client.tensors import calculate_buffer_size
from .control.wire.errors import (
    AuthFailed,
    BadRequest,
    Busy,
    ConnectionLost,
    Forbidden,
    NotFound,
    OutOfMemory,
    OutOfRange,
    QuotaExceeded,
    RpcBufError,
    ShuttingDown,
    Timeout,
    TokenExpired,
    UcxUnusable,
    UnsupportedDevice,
    VerifyFailed,
)
from .dataplane.checksum import checksum
from .models.attached import AttachedModel, attach_model
from .models.info import ModelInfo, TensorInfo, model_info
from .models.loader import LoadResult, unload_model
from .models.placement import Placement
from .models.sources import load_model

__version__: str

__all__ = [
    "AttachedModel",
    "AuthFailed",
    "BadRequest",
    "BlockCluster",
    "BufferPool",
    "Busy",
    "Cluster",
    "ClusterError",
    "ConnectionLost",
    "Connector",
    "Forbidden",
    "LoadResult",
    "ModelInfo",
    "NotFound",
    "OutOfMemory",
    "OutOfRange",
    "Placement",
    "QuotaExceeded",
    "RpcBufError",
    "RpcContext",
    "ShuttingDown",
    "TensorInfo",
    "Timeout",
    "TokenExpired",
    "UcxUnusable",
    "UnsupportedDevice",
    "VerifyFailed",
    "attach_model",
    "calculate_buffer_size",
    "checksum",
    "connect",
    "create_rpc_context",
    "load_model",
    "model_info",
    "unload_model",
]
