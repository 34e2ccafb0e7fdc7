"""LMCache's own engine on the CPU, as the integration tests and the KV
benchmark drive it: ``make_engine`` builds an ``LMCacheEngine`` (its
StorageManager, LocalCPUBackend, RemoteBackend, serde and connector are all
LMCache's real code) for a small model shape, with rpcbuf (or any remote)
behind it.

The one stand-in is the engine's "GPU connector": every bundled one needs
CUDA, so ``DenseCPUConnector`` copies between a dense CPU KV tensor of shape
(layers, 2, tokens, heads, head_dim) and each chunk's ``memory_obj.tensor``
(LMCache's KV_2LTD layout: 2, layers, tokens, heads * head_dim).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

CHUNK = 256  # tokens per chunk
_ids = itertools.count()


class DenseCPUConnector(GPUConnectorInterface):
    """Copies chunks between ``kwargs["kv"]``, a CPU tensor of shape
    (layers, 2, tokens, heads, head_dim), and the engine's memory objects."""

    def __init__(self, layers: int, heads: int, head_dim: int) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim

    def _view(self, kv: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # (layers, 2, n, heads, head_dim) -> (2, layers, n, heads * head_dim)
        return kv[:, :, start:end].permute(1, 0, 2, 3, 4).reshape(
            2, self.layers, end - start, self.heads * self.head_dim)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self._view(kwargs["kv"], start, end))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kv = kwargs["kv"]
        src = memory_obj.tensor.reshape(2, self.layers, end - start, self.heads, self.head_dim)
        kv[:, :, start:end].copy_(src.permute(1, 0, 2, 3, 4))

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.heads * self.head_dim])


def make_engine(*, layers: int = 4, heads: int = 8, head_dim: int = 128,
                dtype: torch.dtype = torch.bfloat16, local_cpu_bytes: int = 1 << 30,
                save_unfull_chunk: bool = False, **remote: Any) -> tuple[LMCacheEngine, str]:
    """An LMCache engine of that shape (a chunk of 256 tokens is
    layers * 2 * 256 * heads * head_dim * dtype bytes: 4 MiB for the
    defaults) and its instance id; ``remote``: the config's remote fields
    (``remote_url``, ``remote_storage_plugins``, ``extra_config``, ...)."""
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=local_cpu_bytes / (1 << 30),
        remote_serde="naive", save_unfull_chunk=save_unfull_chunk, **remote)
    metadata = LMCacheMetadata(
        model_name="tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=dtype, kv_shape=(layers, 2, CHUNK, heads, head_dim), chunk_size=CHUNK)
    instance = f"rpcbuf-test-{next(_ids)}"
    engine = LMCacheEngineBuilder.get_or_create(
        instance, config, metadata, DenseCPUConnector(layers, heads, head_dim),
        lambda t, r: None, lambda o, r: o)
    engine.post_init()
    return engine, instance


def destroy(instance: str) -> None:
    LMCacheEngineBuilder.destroy(instance)


def kv_tensor(tokens: int, *, layers: int = 4, heads: int = 8, head_dim: int = 128,
              dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, tokens, heads, head_dim, generator=g).to(dtype)
