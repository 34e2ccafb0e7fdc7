"""Named tensor layouts: which tensor lives at which offset of a remote buffer.

``store_tensors`` gives each tensor an aligned slot (256 bytes, GPU-friendly),
stores them all in one batch (one control round trip; touching small tensors
travel as one UCX message) and has the daemon record a manifest — name ->
dtype, shape, offset, nbytes, checksum — that ``get_buffer_meta`` returns
under ``tensors``.  ``load_tensors`` reads them back, with their dtype and
shape, in one batch; any process of the same tenant can do so once it has
the buffer id (``open_buffer(name)`` finds a named buffer).

The checksum in the manifest is the daemon's xxh3-64 of the bytes it
received; ``load_tensors(verify=True)`` recomputes it on what arrived.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dataplane.checksum import checksum

from . import protocol as P
from .errors import BadRequest, NotFound, VerifyFailed

if TYPE_CHECKING:
    from collections.abc import Sequence

ALIGN = 256


def _align(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def _nbytes(spec: Any) -> int:
    """Bytes of an array, or of a ``(shape, dtype)`` spec."""
    if hasattr(spec, "nbytes"):
        return int(spec.nbytes)
    try:
        shape, dtype = spec
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    except (TypeError, ValueError):
        raise BadRequest(f"expected an array or a (shape, dtype) pair, got {spec!r}") from None


def calculate_buffer_size(tensors: Mapping[str, Any] | Iterable[Any],
                          headroom: float = 0.10, align: int = ALIGN) -> int:
    """Bytes a buffer needs for ``tensors`` (arrays or ``(shape, dtype)``
    specs, as a mapping or a sequence) in aligned slots, plus ``headroom``."""
    if headroom < 0:
        raise BadRequest("headroom must be >= 0")
    specs = tensors.values() if isinstance(tensors, Mapping) else tensors
    total = sum(_align(_nbytes(s), align) for s in specs)
    return _align(int(total * (1.0 + headroom)), align)


def named_arrays(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``{name: array}`` as NumPy arrays; BAD_REQUEST for a non-string name or
    an array of Python objects."""
    arrays: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if not isinstance(name, str):
            raise BadRequest(f"tensor names must be strings, got {name!r}")
        a = np.asarray(arr)
        if a.dtype.hasobject:
            raise BadRequest(f"tensor {name!r} holds Python objects")
        arrays[name] = a
    return arrays


Columns = tuple[list[str], list[str], list[list[int]]]


def manifest_columns(arrays: Mapping[str, Any], names: Iterable[str]) -> Columns:
    """(names, dtypes, shapes) of ``names``: the manifest a batch records."""
    names = list(names)
    return (names, [arrays[n].dtype.str for n in names],
            [list(arrays[n].shape) for n in names])


def plan_layout(tensors: Mapping[str, Any], existing: Mapping[str, Mapping[str, Any]],
                start: int | None = None, end: int | None = None) -> dict[str, int]:
    """Offsets for ``tensors``: a name already in the manifest with the same
    size keeps its slot; the others go after the highest slot in use (``end``,
    else computed from ``existing``) or at ``start``, in the mapping's order,
    each aligned."""
    if end is None:
        end = max((_align(e["offset"] + e["nbytes"]) for e in existing.values()), default=0)
    cursor = _align(end if start is None else start)
    out: dict[str, int] = {}
    for name, arr in tensors.items():
        old = existing.get(name)
        if start is None and old is not None and old["nbytes"] == arr.nbytes:
            out[name] = int(old["offset"])
            continue
        out[name] = cursor
        cursor = _align(cursor + int(arr.nbytes))
    return out


@dataclass
class _Manifest:
    """A client's copy of one buffer's manifest, valid while ``version`` is."""

    version: int
    end: int
    entries: dict[str, dict[str, Any]]

    def update(self, version: int, written: dict[str, dict[str, Any]],
               dropped: list[str]) -> None:
        for name in dropped:
            self.entries.pop(name, None)
        self.entries.update(written)
        self.version = version
        self.end = max([self.end] + [_align(e["offset"] + e["nbytes"])
                                     for e in written.values()])


class TensorOps:
    """Mixin for ``RpcContext``: the named-tensor layer over the batch ops."""

    _manifests: dict[str, _Manifest]

    if TYPE_CHECKING:  # provided by RpcContext
        async def get_buffer_meta(self, buffer_id: str, tensors: bool = True,
                                  ) -> dict[str, Any]: ...

        async def store_batch(
            self, buffer_id: str, items: Sequence[tuple[int, Any]], verify: str | None = None,
            manifest: tuple[list[str], list[str], list[list[int]]] | None = None,
            manifest_version: int | None = None,
        ) -> dict[str, Any]: ...

        async def read_batch(self, buffer_id: str,
                             ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]: ...

    async def store_tensors(self, buffer_id: str, tensors: Mapping[str, Any],
                            offset: int | None = None,
                            verify: str | None = None) -> dict[str, dict[str, Any]]:
        """Store ``{name: array}`` at aligned offsets and record the manifest.

        Returns the manifest entries written (name -> offset, nbytes, ...).
        Names already stored with the same size are overwritten in place;
        ``offset`` places the new slots from there instead.  Two clients
        storing into one buffer at once should use distinct ``offset``s.
        Raises NOT_FOUND, OUT_OF_RANGE (the buffer is too small: size it with
        ``calculate_buffer_size``), VERIFY_FAILED, BAD_REQUEST."""
        arrays = named_arrays(tensors)
        names, dtypes, shapes = manifest_columns(arrays, arrays)
        for attempt in (0, 1):
            cached = self._manifests.get(buffer_id)
            if cached is None:
                await self.get_buffer_meta(buffer_id)  # fills the cache
                cached = self._manifests[buffer_id]
            offsets = plan_layout(arrays, cached.entries, offset, cached.end)
            try:
                result = await self.store_batch(
                    buffer_id, [(offsets[n], arrays[n]) for n in names], verify=verify,
                    manifest=(names, dtypes, shapes), manifest_version=cached.version)
                break
            except BadRequest as exc:
                # Another client changed the manifest since we cached it: the
                # daemon refused before any byte landed; re-read and re-plan once.
                self._manifests.pop(buffer_id, None)
                if attempt or exc.details.get("reason") != "manifest_changed":
                    raise
        assert cached is not None
        written = {n: {"dtype": d, "shape": s, "offset": offsets[n],
                       "nbytes": int(arrays[n].nbytes), "checksum": c}
                   for n, d, s, c in zip(names, dtypes, shapes,
                                         P.unpack_u64(result["checksums"]).tolist(), strict=True)}
        cached.update(result["manifest_version"], written, result.get("dropped", []))
        return written

    def _remember_manifest(self, buffer_id: str, meta: dict[str, Any]) -> None:
        if meta.get("tensors") is not None:
            self._manifests[buffer_id] = _Manifest(
                meta["manifest_version"], meta["tensors_end"], dict(meta["tensors"]))

    async def _manifest_of(self, buffer_id: str) -> dict[str, dict[str, Any]]:
        """The manifest, from the cache when its version is still current
        (a small answer) and from the daemon otherwise."""
        cached = self._manifests.get(buffer_id)
        if cached is not None:
            meta = await self.get_buffer_meta(buffer_id, tensors=False)
            if meta["manifest_version"] == cached.version:
                return cached.entries
        return dict((await self.get_buffer_meta(buffer_id))["tensors"])

    async def load_tensors(self, buffer_id: str, names: Iterable[str] | None = None,
                           verify: bool = True) -> dict[str, np.ndarray]:
        """``{name: array}`` with the stored dtype and shape, in one batch.

        With ``verify`` each tensor's xxh3 is compared with the manifest.
        Raises NOT_FOUND (buffer, or a name not in its manifest), VERIFY_FAILED."""
        manifest = await self._manifest_of(buffer_id)
        wanted = list(manifest) if names is None else list(names)
        missing = [n for n in wanted if n not in manifest]
        if missing:
            raise NotFound(f"no tensor(s) {missing[:5]} in this buffer's manifest",
                           {"missing": missing[:20]})
        entries = [manifest[n] for n in wanted]
        raw = await self.read_batch(buffer_id, [(e["offset"], e["nbytes"]) for e in entries])
        out: dict[str, np.ndarray] = {}
        bad: list[str] = []
        for name, e, data in zip(wanted, entries, raw, strict=True):
            if verify and e.get("checksum") is not None and checksum(data) != e["checksum"]:
                bad.append(name)
            out[name] = data.view(np.dtype(e["dtype"])).reshape(e["shape"])
        if bad:
            raise VerifyFailed(f"{len(bad)} tensor(s) do not match their manifest checksum",
                               {"tensors": bad[:20]})
        return out
