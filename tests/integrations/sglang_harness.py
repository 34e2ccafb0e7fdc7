"""SGLang's HiCache storage classes on the CPU, as the integration tests and
the KV benchmark drive them: ``storage_config`` is SGLang's own
``HiCacheStorageConfig``, ``make`` builds a backend through SGLang's own
``StorageBackendFactory`` (rpcbuf by module path, as the ``dynamic``
backend a user configures; SGLang's ``file`` backend, ``HiCacheFile``, by
its name) and registers the host pool as SGLang's cache controller does.

The one stand-in is the host KV pool.  SGLang 0.5.23's
``MHATokenToKVPoolHost`` does not import on the CPU with the short
dependency list (its module imports the device pools, which pull the model
configs (transformers, torchvision) and the device communicators
(tvm_ffi)), so ``HostPool`` is the smallest pool with its page_first
layout: ``kv_buffer`` of shape (2, tokens, layers, heads, head_dim), and
the calls the storage backends make of it (``get_page_buffer_meta``,
``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page``,
``get_size_per_token``), each written as ``MHATokenToKVPoolHost``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

# (layers, KV heads, head_dim) at TP 1, bf16, pages of 64 tokens (SGLang's
# page is the server's --page-size; 64 is a usual setting with a storage tier).
# Bytes per page = 2 (K, V) * 64 * layers * heads * head_dim * 2.
SHAPES = {
    "small": (2, 2, 64),  # a tiny test model: 64 KiB a page
    "qwen2.5-0.5b": (24, 2, 64),  # Qwen2.5-0.5B: 768 KiB a page
    "llama-3-8b": (32, 8, 128),  # Llama-3-8B (a 7B-class GQA model): 8 MiB a page
}
PAGE = 64


class HostPool:
    """A host KV pool in MHATokenToKVPoolHost's page_first layout (see the module)."""

    layout = "page_first"

    def __init__(self, pages: int, layers: int, heads: int, head_dim: int,
                 page_size: int = PAGE, dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = (
            page_size, layers, heads, head_dim)
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        self.page_num = pages
        self.size = pages * page_size
        self.kv_buffer = torch.zeros((2, self.size, layers, heads, head_dim), dtype=dtype)

    def get_size_per_token(self) -> int:
        return 2 * self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2

    def slots(self, first_page: int, n: int) -> torch.Tensor:
        """The token slots of pages ``first_page`` .. ``first_page + n - 1``."""
        lo = first_page * self.page_size
        return torch.arange(lo, lo + n * self.page_size, dtype=torch.int64)

    def fill(self, first_page: int, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lo, hi = first_page * self.page_size, (first_page + n) * self.page_size
        shape = self.kv_buffer[:, lo:hi].shape
        self.kv_buffer[:, lo:hi] = torch.randn(shape, generator=g).to(self.dtype)

    def pages(self, first_page: int, n: int) -> torch.Tensor:
        lo, hi = first_page * self.page_size, (first_page + n) * self.page_size
        return self.kv_buffer[:, lo:hi].clone()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index:index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index:index + self.page_size, :, :, :] = data_page.reshape(
            2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        base = self.kv_buffer.data_ptr()
        item = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs = []
        for i in indices.tolist()[::self.page_size]:
            k = base + i * self.layer_num * self.head_num * self.head_dim * item
            ptrs += [k, k + v_offset]
        size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)


def storage_config(model: str = "tiny/model", *, tp_rank: int = 0, tp_size: int = 1,
                   extra: dict[str, Any] | None = None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=True,
        is_page_first_layout=True, model_name=model, extra_config=extra)


def rpcbuf_extra(endpoints: str, token: str, **more: Any) -> dict[str, Any]:
    """The extra_config a user pastes (docs/kvcache.md)."""
    return {"backend_name": "rpcbuf", "module_path": "rpcbuf_sglang",
            "class_name": "RpcbufHiCacheStorage", "interface_v1": 1,
            "endpoints": endpoints, "token": token, **more}


def make(backend: str, pool: HostPool, model: str = "tiny/model", **kw: Any) -> Any:
    """``StorageBackendFactory.create_backend`` then ``register_mem_pool_host``,
    as SGLang's cache controller attaches a backend."""
    config = storage_config(model, **kw)
    made = StorageBackendFactory.create_backend(backend, config, pool)
    made.register_mem_pool_host(pool)
    return made


def file_extra(path: Path) -> dict[str, Any]:
    return {"file_storage_path": str(path)}
