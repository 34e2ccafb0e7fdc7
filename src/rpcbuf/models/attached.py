"""``rpcbuf.attach_model``: every tensor of a loaded model on this node, in place
and read-only, beside its ``TensorInfo``.  A GGUF Q8_0 matrix of logical shape
(512, 256) is a ``uint8`` array (512, 272) with ``source_type == "Q8_0"``.

``framework="torch"`` hands out torch tensors over the same pages (DLPack, no
copy), of the dtype the source type names.  Torch has no read-only tensors: the
pages are mapped ``PROT_READ``, so a write through one kills the process
(SIGSEGV).  Build a model on them with ``torch.device("meta")`` and
``load_state_dict(dict(model), assign=True)`` (docs/dataplane.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from rpcbuf.control.client.arrays import check_framework, torch_view
from rpcbuf.control.client.attach import Attachment, tensor_view
from rpcbuf.control.client.opening import Opening
from rpcbuf.control.wire.manifest import RESERVED
from rpcbuf.models.info import ModelInfo, TensorInfo, model_info
from rpcbuf.models.record import incomplete

if TYPE_CHECKING:
    from rpcbuf.control.client.context import RpcContext


class AttachedModel(Mapping[str, Any]):
    """``model[name]`` is the array, ``model.info[name]`` its ``TensorInfo``,
    ``model.metadata`` the file's key/values; ``close()`` (or ``async with``) detaches."""

    def __init__(self, info: ModelInfo, views: dict[str, Attachment],
                 framework: str = "numpy") -> None:
        self.name = info.name
        self.description = info
        self.metadata: dict[str, Any] = info.metadata
        self.format = info.format
        self.info: dict[str, TensorInfo] = {
            k: v for k, v in info.tensors.items() if k not in RESERVED}
        self.framework = framework
        self._views = views
        self._arrays: dict[str, Any] | None = {}
        for name, t in self.info.items():
            view = views[t.buffer_id]
            array = tensor_view(view.array(), t.entry, view.size)
            self._arrays[name] = array if framework == "numpy" else torch_view(
                array, t.source_type, t.logical_shape)

    def __getitem__(self, name: str) -> Any:
        if self._arrays is None:
            raise KeyError(f"{name!r}: the model's attachment is closed")
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.info)

    def __len__(self) -> int:
        return len(self.info)

    async def close(self) -> None:
        """Detach every slot buffer (arrays still alive keep their mapping)."""
        self._arrays = None
        for view in self._views.values():
            await view.close()

    async def __aenter__(self) -> AttachedModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def attach_model(ctx: RpcContext, name: str, framework: str = "numpy"
                 ) -> Opening[AttachedModel]:
    """Every tensor of model ``name`` on ``ctx``'s node, zero-copy, read-only
    (``async with rpcbuf.attach_model(ctx, "llama") as m``); same host only.
    ``framework="torch"``: torch tensors over read-only pages (a write: SIGSEGV).
    Raises NOT_FOUND (not here; ``reason: incomplete`` with ``problems`` for a
    load that did not finish or tensors changed since), BAD_REQUEST (not same
    host, a bad answer, unknown framework, no torch), and what ``ctx.attach``
    raises (UNSUPPORTED_DEVICE, QUOTA_EXCEEDED)."""
    check_framework(framework)
    return Opening(lambda: _attach_model(ctx, name, framework))


async def _attach_model(ctx: RpcContext, name: str, framework: str) -> AttachedModel:
    info = await model_info(ctx, name)
    if not info.complete:  # an inference engine must never start on part of a model
        raise incomplete(name, info.problems, f" on {ctx.node_id}")
    views: dict[str, Attachment] = {}
    try:
        for slot in info.slots:
            views[slot.buffer_id] = await ctx.attach(slot.buffer_id)
        # Attached, its buffers refuse writes (BUSY); before, a load over the
        # model may have begun between the check above and the attaches.
        again = await model_info(ctx, name)
        if not again.complete or _state(again) != _state(info):
            raise incomplete(name, again.problems or [
                "it changed while it was being attached (a load over it began)"],
                f" on {ctx.node_id}")
        return AttachedModel(info, views, framework)
    except BaseException:
        for view in views.values():
            await view.close()
        raise


def _state(info: ModelInfo) -> tuple[Any, ...]:
    """What must not change between the check and the attaches."""
    return (tuple(s.buffer_id for s in info.slots),
            tuple((n, t.buffer_id, t.offset, t.nbytes, t.checksum)
                  for n, t in info.tensors.items()))
