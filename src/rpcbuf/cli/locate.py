"""Where a named buffer (or a model's tensor) is, for ``get`` and ``release``:
every node is asked at once.  NOT_FOUND from one node is no failure when another
holds it; a node that cannot answer is (it may hold it).  Found nowhere: one
NOT_FOUND naming every node; found on several, ``get`` refuses to choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rpcbuf.control.wire.errors import BadRequest, NotFound, RpcBufError

if TYPE_CHECKING:
    from rpcbuf.control.client.cluster import Cluster
    from rpcbuf.control.client.context import RpcContext


@dataclass(frozen=True)
class Found:
    buffer_id: str
    name: str  # what the buffer is called (its id if it has no name)
    tensor: str | None = None  # the tensor asked for (``--tensor``), in that buffer


async def resolve(ctx: RpcContext, ref: str) -> str:
    """An id this tenant holds, else a buffer name.  Raises NOT_FOUND."""
    if ref.startswith("b-"):
        try:
            await ctx.get_buffer_meta(ref, tensors=False)
            return ref
        except NotFound as exc:
            if exc.details.get("reason") == "lease_expired":
                raise  # that id was a buffer here: its words, not the name's
    return await ctx.open_buffer(ref)


async def locate(ctx: RpcContext, ref: str, tensor: str | None) -> Found:
    """``ref`` on ``ctx``'s node: a buffer, or with ``tensor`` a model's slot
    holding it.  Raises NOT_FOUND (``reason: no_such_tensor``: model here, tensor not)."""
    try:
        return Found(await resolve(ctx, ref), ref, tensor)
    except NotFound:
        if tensor is None:
            raise
    from rpcbuf.models.info import model_info

    model = await model_info(ctx, ref)  # NOT_FOUND: none of the model here either
    where = model.tensors.get(tensor)
    if where is None:
        raise NotFound(f"model {ref!r} has no tensor {tensor!r} on this node",
                       {"reason": "no_such_tensor", "missing": [tensor]})
    slot = next(s for s in model.slots if s.buffer_id == where.buffer_id)
    return Found(where.buffer_id, slot.name or where.buffer_id, tensor)


def nowhere(ref: str, tensor: str | None, addrs: list[str], model_here: bool) -> NotFound:
    where = addrs[0] if len(addrs) == 1 else f"any of {len(addrs)} nodes ({', '.join(addrs)})"
    if model_here:
        return NotFound(f"model {ref!r} has no tensor {tensor!r} on {where}",
                        {"reason": "no_such_tensor", "missing": [tensor], "asked": addrs})
    what = f"buffer or model {ref!r}" if tensor else f"buffer {ref!r}"
    return NotFound(f"no {what} on {where}", {"reason": "nowhere", "asked": addrs})


async def find(cluster: Cluster, ref: str, tensor: str | None = None
               ) -> tuple[dict[str, Found], dict[str, RpcBufError]]:
    """``({endpoint: found}, {endpoint: error})`` without the NOT_FOUNDs, unless
    no node holds it: then one NOT_FOUND under ``"*"``."""
    got = await cluster.each(lambda c: locate(c, ref, tensor))
    found = {a: r for a, r in got.items() if isinstance(r, Found)}
    errors = {a: r for a, r in got.items()
              if isinstance(r, RpcBufError) and not isinstance(r, NotFound)}
    lapsed = {a: r for a, r in got.items()
              if isinstance(r, NotFound) and r.details.get("reason") == "lease_expired"}
    if not found and not errors and lapsed:
        errors = dict(lapsed)  # the words about the lease, not a bare "nowhere"
    if not found and not errors:
        model_here = any(isinstance(r, NotFound) and r.details.get("reason") == "no_such_tensor"
                         for r in got.values())
        errors = {"*": nowhere(ref, tensor, list(got), model_here)}
    return found, errors


def one(ref: str, found: dict[str, Found]) -> tuple[str, Found]:
    """The only node holding ``ref``.  Raises BAD_REQUEST when several do."""
    if len(found) > 1:
        raise BadRequest(f"{ref!r} is on {len(found)} nodes ({', '.join(found)}): pass "
                         "--endpoint to pick one", {"reason": "ambiguous",
                                                    "nodes": list(found)})
    ((addr, where),) = found.items()
    return addr, where
