"""SGLang's ``extra_config`` read into ``Settings``, and the key namespace
``Names`` from its ``HiCacheStorageConfig``, all checked when the backend is
made (a bad setting is a ValueError naming it).  No SGLang import.

A page's blocks are ``<prefix><page hash>.<part>``: the prefix
``"sgl:<tag>:<model>:<shard>:<layout>.<dtype>:"`` names the model, the shard
(TP rank and size, or for replicated MLA KV the PP/CP coordinates, as SGLang's
file backend) and the host pool's byte form; the part is ``k`` or ``v`` (``k``
alone for MLA).  So two models, ranks, layouts or tags never share a key (two
tenants never share a key space at all).  A page hash that is not 1 to
``MAX_HASH`` printable characters is a miss before anything is sent.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import xxhash

from rpcbuf.control.wire.membership import DEFAULT_CLUSTER

MAX_HASH = 256  # characters of one page hash (SGLang's are 64: a sha256 in hex)
MAX_NAME = 96  # characters of the model name and of the tag, as they enter keys
DEFAULT_TIMEOUT = 10.0  # s per call: past it the call is a miss
MAX_TIMEOUT = 600.0
MAX_TTL = 365 * 86400.0


@dataclass(frozen=True)
class Settings:
    endpoints: str  # "h1:7700;h2:7700" or "etcd://h:2379"
    token: str
    ttl: float | None
    timeout: float
    replicas: int
    cluster: str
    same_host: bool | None
    tag: str

    @classmethod
    def read(cls, extra: dict[str, Any] | None) -> Settings:
        """``endpoints`` (or ``endpoint``; else $RPCBUF_ENDPOINTS, else
        127.0.0.1:7700), ``token`` (else $RPCBUF_TOKEN; required), ``ttl``,
        ``timeout``, ``replicas``, ``cluster``, ``same_host``, ``namespace``.
        Raises ValueError naming the setting that is wrong."""
        x = dict(extra or {})
        raw = x.get("endpoints", x.get("endpoint")) or os.environ.get("RPCBUF_ENDPOINTS") \
            or "127.0.0.1:7700"
        endpoints = _text("endpoints", raw, 4096).strip()
        if not endpoints.startswith("etcd"):
            endpoints = ";".join(e.strip().removeprefix("rpcbuf://")
                                 for e in endpoints.replace(",", ";").split(";") if e.strip())
        if not endpoints:
            raise ValueError("rpcbuf_sglang: extra_config 'endpoints' names no node")
        token = x.get("token") or os.environ.get("RPCBUF_TOKEN")
        if not token:
            raise ValueError("rpcbuf_sglang: no token (set extra_config 'token' or "
                             "$RPCBUF_TOKEN)")
        same = x.get("same_host")
        return cls(
            endpoints=endpoints,
            token=_text("token", token, 8192),
            ttl=None if x.get("ttl") in (None, "", 0) else _number("ttl", x["ttl"], MAX_TTL),
            timeout=_number("timeout", x.get("timeout", DEFAULT_TIMEOUT), MAX_TIMEOUT),
            replicas=int(_number("replicas", x.get("replicas", 1), 16)),
            cluster=_text("cluster", x.get("cluster") or DEFAULT_CLUSTER, 128),
            same_host=None if same is None else _flag("same_host", same),
            tag=_text("namespace", x.get("namespace") or "", MAX_NAME),
        )


def _text(name: str, value: Any, most: int) -> str:
    if not isinstance(value, str) or len(value) > most or not value.isprintable():
        raise ValueError(f"rpcbuf_sglang: extra_config {name!r} must be printable text of "
                         f"at most {most} characters")
    return value


def _number(name: str, value: Any, most: float) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    if isinstance(value, bool) or not 0 < out <= most:
        raise ValueError(f"rpcbuf_sglang: extra_config {name!r} must be a number above 0 "
                         f"and at most {most:g}")
    return out


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("0", "1", "true", "false"):
        return value.strip().lower() in ("1", "true")
    raise ValueError(f"rpcbuf_sglang: extra_config {name!r} must be true or false")


def _name(text: str) -> str:
    """``text`` as it may enter a key: "/" as "-", a long or unprintable name
    as its hash."""
    text = "-".join(text.split("/"))
    if len(text) <= MAX_NAME and text.isprintable() and ":" not in text:
        return text
    return "x" + xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Names:
    """Page hashes to block keys, for one model and shard (see the module)."""

    prefix: str
    parts: tuple[str, ...]  # ("k", "v"), or ("k",) for MLA

    @classmethod
    def of(cls, storage_config: Any, tag: str = "", pool: Any = None) -> Names:
        """With the host ``pool``, its layout and dtype too (a page's bytes lie in
        another order under another layout)."""
        c = storage_config
        model = _name(str(getattr(c, "model_name", None) or ""))
        mla = bool(getattr(c, "is_mla_model", False))
        shard = "" if mla else f"tp{int(c.tp_rank)}of{int(c.tp_size)}"
        if int(getattr(c, "pp_size", 1)) > 1:
            shard += f"pp{int(c.pp_rank)}of{int(c.pp_size)}"
        if int(getattr(c, "attn_cp_size", 1)) > 1:
            shard += f"cp{int(c.attn_cp_rank)}of{int(c.attn_cp_size)}"
        if int(getattr(c, "dcp_size", 1) or 1) > 1:
            shard += f"dcp{int(c.dcp_rank)}of{int(c.dcp_size)}page{c.logical_page_size}"
        form = ""
        if pool is not None:
            dtype = str(getattr(pool, "dtype", "")).removeprefix("torch.")
            form = _name(f"{getattr(pool, 'layout', '')}.{dtype}")
        return cls(f"sgl:{_name(tag)}:{model}:{shard}:{form}:", ("k",) if mla else ("k", "v"))

    def keys(self, page_hash: Any) -> list[str] | None:
        """The block keys of one page, or None for a hash that cannot be one."""
        if not isinstance(page_hash, str) or not 0 < len(page_hash) <= MAX_HASH \
                or not page_hash.isprintable():
            return None
        return [f"{self.prefix}{page_hash}.{p}" for p in self.parts]
