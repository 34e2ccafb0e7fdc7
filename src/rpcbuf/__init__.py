"""rpcbuf: remote GPU/host buffers for distributed LLM inference.

The public face only re-exports; the logic lives in ``control`` and ``dataplane``.
"""

from control.client.cluster import Cluster, ClusterError
from control.client.connect import Connector, connect, create_rpc_context
from control.client.context import RpcContext
from control.client.model.attached import AttachedModel, attach_model
from control.client.model.info import ModelInfo, TensorInfo, model_info
from control.client.model.loader import LoadResult, unload_model
from control.client.model.placement import Placement
from control.client.model.sources import load_model
from control.client.pool import BufferPool
from control.client.tensors import calculate_buffer_size
from control.wire.errors import (
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
from control.wire.version import VERSION
from dataplane.checksum import checksum

__version__ = VERSION

__all__ = [
    "AttachedModel",
    "AuthFailed",
    "BadRequest",
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
