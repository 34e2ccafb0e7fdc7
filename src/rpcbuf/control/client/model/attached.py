"""``rpcbuf.attach_model``: every tensor of a loaded model on this node, in
place, read-only, with what an inference engine needs to use it.

It reads the model's description from the node (``info.model_info``: its
slot buffers, each tensor's NumPy view dtype and shape, its source type and
logical shape, the file's metadata), refuses a model this node does not
hold complete (``record``: a load interrupted or still running), attaches every slot buffer
(``ctx.attach``: zero-copy, read-only; stores into them are BUSY while
attached), and hands out each tensor as an array over the daemon's memory
beside its ``TensorInfo``.  A GGUF Q8_0 matrix of logical shape (512, 256)
is a ``uint8`` array of shape (512, 272) with ``source_type == "Q8_0"``; a
safetensors BF16 tensor is ``<u2`` bits with ``source_type == "BF16"``.

``framework="torch"`` hands out torch tensors over the same pages instead
(``arrays.torch_view``: DLPack, no copy, no "not writable" warning), each of
the dtype its source type names (a BF16 tensor is bfloat16).  Torch has no
read-only tensors: the pages are mapped ``PROT_READ``, so a write through
one (an in-place op, ``copy_``, an optimizer step) is refused by the kernel,
and the process dies of SIGSEGV.  An inference worker builds its model on
them without a copy: ``torch.device("meta")`` for the module, then
``module.load_state_dict(dict(model), assign=True)`` (docs/dataplane.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from rpcbuf.control.client.arrays import check_framework, torch_view
from rpcbuf.control.client.attach import Attachment, tensor_view
from rpcbuf.control.client.model.info import ModelInfo, TensorInfo, model_info
from rpcbuf.control.client.model.record import incomplete
from rpcbuf.control.client.opening import Opening
from rpcbuf.control.wire.manifest import RESERVED

if TYPE_CHECKING:
    from rpcbuf.control.client.context import RpcContext


class AttachedModel(Mapping[str, Any]):
    """A loaded model's tensors on this node, by name, over the daemon's
    memory: ``model[name]`` is the array, ``model.info[name]`` its
    ``TensorInfo`` (source type, logical shape, ...), ``model.metadata`` the
    file's own key/values.  ``close()`` (or ``async with``) detaches.
    ``framework``: "numpy" (arrays) or "torch" (tensors, see above)."""

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
        """Detach every slot buffer (arrays still alive keep theirs: see
        ``control/client/attach.py``)."""
        self._arrays = None
        for view in self._views.values():
            await view.close()

    async def __aenter__(self) -> AttachedModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def attach_model(ctx: RpcContext, name: str, framework: str = "numpy"
                 ) -> Opening[AttachedModel]:
    """Every tensor of model ``name`` that lives on ``ctx``'s node, zero-copy
    and read-only: ``async with rpcbuf.attach_model(ctx, "llama") as m:`` (or
    ``m = await ...`` and ``await m.close()``).  Needs the same-host path.
    ``framework="torch"``: torch tensors, each of its file's dtype, over the
    same read-only pages (a write through one kills the process: SIGSEGV).
    Raises NOT_FOUND (no such model on this node; ``reason: incomplete``
    for one whose load did not finish or whose tensors changed since, with
    ``problems`` naming what is missing), BAD_REQUEST (not same host, a bad
    answer, an unknown framework, torch not installed), what ``ctx.attach``
    raises for a slot buffer (UNSUPPORTED_DEVICE: a GPU buffer without VMM
    handles; QUOTA_EXCEEDED: too many attachments), BUSY never (attach only
    reads)."""
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
