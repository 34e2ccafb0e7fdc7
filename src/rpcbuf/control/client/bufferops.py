"""The quick control ops of a context: buffers made, found, described,
renewed, released, cleared and copied on the node, and what the node says
of itself.  One request each; a metadata answer notes the buffer's place
and, with the manifest, updates the manifest cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rpcbuf.control.client.answers import (
    parse_buffers,
    parse_devices,
    parse_expiry,
    parse_meta,
    parse_stats,
)
from rpcbuf.control.client.connection import Caller
from rpcbuf.control.client.rangeops import Places
from rpcbuf.control.client.tensorops import TensorOps
from rpcbuf.control.wire import protocol as P


class BufferOps:
    def __init__(self, caller: Caller, places: Places, manifests: TensorOps,
                 check_open: Callable[[], None]) -> None:
        self._caller, self._places, self._manifests = caller, places, manifests
        self._check_open = check_open

    async def _call(self, req: P.Request, timeout: float | None) -> dict[str, Any]:
        self._check_open()
        return await self._caller.call(req, timeout)

    async def _buffer(self, req: P.Request, timeout: float | None) -> str:
        """The id in the metadata answering ``req``, its place noted."""
        meta = parse_meta(await self._call(req, timeout), f"{req.op} answer")
        self._places.note(meta)
        return meta.buffer_id

    async def request_buffer(self, size: int, device_type: str, device: int,
                             timeout: float | None, ttl: float | None, name: str | None) -> str:
        # The daemon waits up to ``timeout`` for memory: the answer may take that long more.
        wait = None if not timeout else timeout + (self._caller.timeout or 0)
        return await self._buffer(P.RequestBuffer(size=size, device_type=device_type,
                                                  device=device, timeout=timeout, ttl=ttl,
                                                  name=name), wait)

    async def clone_buffer(self, src_id: str, name: str | None, ttl: float | None) -> str:
        return await self._buffer(P.CloneBuffer(src_id=src_id, name=name, ttl=ttl), None)

    async def open_buffer(self, name: str, timeout: float | None) -> str:
        return await self._buffer(P.OpenBuffer(name=name), timeout)

    async def get_buffer_meta(self, buffer_id: str, tensors: bool,
                              timeout: float | None) -> dict[str, Any]:
        meta = await self._call(P.GetBufferMeta(buffer_id=buffer_id, tensors=tensors), timeout)
        self._places.note(parse_meta(meta))
        if tensors:
            self._manifests.remember(buffer_id, meta)
        return meta

    async def release_buffer(self, buffer_id: str, timeout: float | None) -> None:
        await self._call(P.Release(buffer_id=buffer_id), timeout)
        self._places.forget(buffer_id)

    async def renew_buffer(self, buffer_id: str, ttl: float | None,
                           timeout: float | None) -> float | None:
        return parse_expiry(await self._call(P.Renew(buffer_id=buffer_id, ttl=ttl), timeout),
                            "renew answer")

    async def clear_buffer(self, buffer_id: str, value: int, offset: int,
                           nbytes: int | None) -> None:
        await self._call(P.ClearBuffer(buffer_id=buffer_id, value=value, offset=offset,
                                       nbytes=nbytes), None)

    async def copy_buffer(self, src_id: str, src_offset: int, dst_id: str, dst_offset: int,
                          nbytes: int) -> None:
        await self._call(P.CopyBuffer(src_id=src_id, src_offset=src_offset, dst_id=dst_id,
                                      dst_offset=dst_offset, nbytes=nbytes), None)

    async def list_devices(self, timeout: float | None) -> list[dict[str, Any]]:
        devices: list[dict[str, Any]] = (await self._call(P.ListDevices(), timeout)).get(
            "devices")  # type: ignore[assignment]  # parse_devices checks it is a list of maps
        parse_devices(devices)
        return list(devices)

    async def list_buffers(self, timeout: float | None) -> list[dict[str, Any]]:
        return parse_buffers(await self._call(P.ListBuffers(), timeout))

    async def stats(self, timeout: float | None) -> dict[str, Any]:
        result = await self._call(P.Stats(), timeout)
        parse_stats(result)
        return result

    async def ping(self, timeout: float | None) -> float:
        self._check_open()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._caller.call(P.Ping(), timeout)
        return loop.time() - t0
