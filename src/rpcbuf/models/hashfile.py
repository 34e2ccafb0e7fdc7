"""A model's hash manifest, ``MODEL.rpcbuf-hashes.json`` (``DIR/rpcbuf-hashes.json``
for shards): per file its name and size, per tensor its name, dtypes, shape,
logical shape, byte range and both hashes (xxh3-128, xxh3-64), and the model's
metadata blob (base64).  It is all a node-local load needs: the driver may hold
the manifest without the model.

A manifest is hostile input: ``read_manifest`` bounds it before parsing
(``MAX_BYTES``, nesting, ``MAX_TENSORS``, the metadata's encoded size) and checks
every field.  Against a model at hand (``check_against``) a stale one is
BAD_REQUEST naming the first difference.  Hashes that lie are caught by the
nodes, which verify every tensor they read.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpcbuf.control.client.dedup import content_hashes
from rpcbuf.control.formats.modelheaders import nesting_within
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.manifest import np_dtype
from rpcbuf.models import metadata as MD
from rpcbuf.models.hashcache import HashCache, file_key, tensor_key
from rpcbuf.models.modelfile import ModelFile, open_model

VERSION = 2  # 2: logical shapes and the model's metadata
SUFFIX = ".rpcbuf-hashes.json"
DIR_NAME = "rpcbuf-hashes.json"
MAX_METADATA_CHARS = 4 * -(-MD.MAX_BLOB // 3)  # the base64 of the largest blob
MAX_BYTES = (64 << 20) + MAX_METADATA_CHARS
MAX_TENSORS = 10 * P.MAX_ITEMS
MAX_FILES = 4096
_LEVELS = 6  # {files: [{tensors: [[..., [shape]]]}]}
HASH_BATCH = 256 << 20  # bytes hashed at a time (memory-mapped views: no copies)


@dataclass(frozen=True)
class HashedTensor:
    name: str
    dtype: str  # the NumPy dtype the bytes are recorded as
    source_dtype: str  # the file's own name (BF16, Q4_K ...)
    shape: tuple[int, ...]
    file_offset: int
    nbytes: int
    digest: int  # xxh3-128
    checksum: int  # xxh3-64
    logical_shape: tuple[int, ...] | None = None  # its elements, in NumPy order (None: shape)

    @property
    def source(self) -> tuple[str, tuple[int, ...]]:
        """``(source type, logical shape)``, as an upload records them."""
        return self.source_dtype, self.shape if self.logical_shape is None \
            else self.logical_shape


@dataclass(frozen=True)
class HashedFile:
    name: str  # the file's name (a directory's shard: its name in the directory)
    size: int
    tensors: list[HashedTensor]


@dataclass
class HashedModel:
    path: Path  # the model (or the manifest) on this machine
    format: str
    files: list[HashedFile]
    hashed: int = 0  # bytes this process read to hash them (0: from a manifest or cache)
    source: str = "manifest"  # where the hashes came from: manifest, hashed, cache
    #: the model file's own metadata (``ModelFile.metadata``; {}: none)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def tensors(self) -> Iterator[tuple[int, HashedTensor]]:
        for k, f in enumerate(self.files):
            for t in f.tensors:
                yield k, t

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.tensors)

    def blob(self) -> Any:
        """The metadata tensor an upload of this model stores (``metadata.encode``)."""
        return MD.encode(self.format, self.metadata)

    def to_json(self) -> dict[str, Any]:
        """Raises BAD_REQUEST for metadata that cannot be stored."""
        return {"rpcbuf_hashes": VERSION, "format": self.format,
                "metadata": base64.b64encode(self.blob().tobytes()).decode("ascii"),
                "files": [{"name": f.name, "size": f.size,
                           "tensors": [[t.name, t.dtype, t.source_dtype, list(t.shape),
                                        None if t.logical_shape is None
                                        else list(t.logical_shape),
                                        t.file_offset, t.nbytes, f"{t.digest:032x}",
                                        t.checksum] for t in f.tensors]} for f in self.files]}


def manifest_path(model: str | Path) -> Path:
    p = Path(model)
    return p / DIR_NAME if p.is_dir() else p.with_name(p.name + SUFFIX)


def is_manifest(path: str | Path) -> bool:
    name = Path(path).name
    return name == DIR_NAME or name.endswith(SUFFIX)


# -- from a model ---------------------------------------------------------------------


def _batches(model: ModelFile, limit: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for t in model.tensors:
        if batch and size + t.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(t.name)
        size += t.nbytes
    if batch:
        yield batch


def hash_model(model: ModelFile, use_cache: bool = True) -> HashedModel:
    """Every tensor's hashes, from the model unless the hash cache knows the
    unchanged file; the cache learns them.  Blocking."""
    cache = HashCache() if use_cache else None
    fkeys = [file_key(f) for f in model.files]
    hashes: dict[str, tuple[int, int]] = {}
    hashed = 0
    for names in _batches(model, HASH_BATCH):
        todo = []
        for n in names:
            got = None if cache is None else cache.get(fkeys[model.by_name[n].file],
                                                     _tkey(model, n))
            if got is None:
                todo.append(n)
            else:
                hashes[n] = got
        if todo:
            fresh = content_hashes(model.read(todo))
            hashed += sum(model.by_name[n].nbytes for n in todo)
            hashes.update(fresh)
            if cache is not None:
                for n in todo:
                    cache.put(fkeys[model.by_name[n].file], _tkey(model, n), fresh[n])
    if cache is not None and [file_key(f) for f in model.files] == fkeys:
        cache.save()  # only for files that did not change while they were read
    out = of_model(model, hashes)
    out.hashed = hashed
    out.source = "hashed" if hashed else "cache"
    return out


def _tkey(model: ModelFile, name: str) -> str:
    _, offset = model.where(name)
    return tensor_key(name, offset, model.by_name[name].nbytes)


def of_model(model: ModelFile, hashes: dict[str, tuple[int, int]]) -> HashedModel:
    files = [HashedFile(f.name, os.stat(f).st_size, []) for f in model.files]
    for t in model.tensors:
        k, offset = model.where(t.name)
        digest, checksum = hashes[t.name]
        files[k].tensors.append(HashedTensor(t.name, t.dtype, t.source_dtype, tuple(t.shape),
                                             offset, t.nbytes, digest, checksum,
                                             t.source[1]))
    for f in files:
        f.tensors.sort(key=lambda t: t.file_offset)
    return HashedModel(Path(model.path), model.format, files, metadata=model.metadata)


def write_manifest(hm: HashedModel, path: Path) -> None:
    """Write ``hm`` to ``path`` atomically (a temporary name, then rename)."""
    fd, tmp = tempfile.mkstemp(prefix=".rpcbuf-hashes.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(hm.to_json(), f, separators=(",", ":"))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# -- reading one ------------------------------------------------------------------------


def read_manifest(path: str | Path) -> HashedModel:
    """Raises BAD_REQUEST naming the file and what is wrong; OSError when it
    cannot be read."""
    p = Path(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BYTES:
            raise BadRequest(f"{p}: a hash manifest of {size} bytes (at most {MAX_BYTES})",
                             {"file": str(p)})
        raw = f.read(MAX_BYTES + 1)
    try:
        if not nesting_within(raw, _LEVELS):
            raise ValueError(f"it nests deeper than the {_LEVELS} levels a hash manifest "
                             "has, or its brackets do not balance")
        doc = json.loads(raw)
        return _parse(p, doc)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise BadRequest(f"{p}: not a valid rpcbuf hash manifest: {exc}",
                         {"file": str(p)}) from None


def _int(x: Any, what: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= P.MAX_INT:
        raise ValueError(f"{what} is not an integer in [0, 2**63)")
    return x


def _str(x: Any, what: str) -> str:
    if not isinstance(x, str) or not 0 < len(x) <= P.MAX_STR or not x.isprintable():
        raise ValueError(f"{what} is not a printable string of at most {P.MAX_STR} characters")
    return x


def _parse(p: Path, doc: Any) -> HashedModel:
    if not isinstance(doc, dict) or doc.get("rpcbuf_hashes") != VERSION:
        raise ValueError(f"no 'rpcbuf_hashes': {VERSION} (written by another version?)")
    fmt = doc.get("format")
    if fmt not in ("safetensors", "gguf"):
        raise ValueError("format is neither safetensors nor gguf")
    metadata = _metadata(fmt, doc.get("metadata"))
    files_raw = doc.get("files")
    if not isinstance(files_raw, list) or not 0 < len(files_raw) <= MAX_FILES:
        raise ValueError(f"files is not a list of 1 to {MAX_FILES} files")
    files: list[HashedFile] = []
    names: set[str] = set()
    count = 0
    for k, fr in enumerate(files_raw):
        if not isinstance(fr, dict) or not isinstance(fr.get("tensors"), list):
            raise ValueError(f"file {k} is not an object with tensors")
        fname = _str(fr.get("name"), f"file {k}'s name")
        if "/" in fname or fname in (".", ".."):
            raise ValueError(f"file {k}'s name {fname!r} is not a plain file name")
        fsize = _int(fr.get("size"), f"file {k}'s size")
        count += len(fr["tensors"])
        if count > MAX_TENSORS:
            raise ValueError(f"more than {MAX_TENSORS} tensors")
        tensors = [_tensor(fname, fsize, i, t) for i, t in enumerate(fr["tensors"])]
        for t in tensors:
            if t.name in names:
                raise ValueError(f"tensor {t.name!r} appears twice")
            names.add(t.name)
        files.append(HashedFile(fname, fsize, sorted(tensors, key=lambda t: t.file_offset)))
    return HashedModel(p, fmt, files, metadata=metadata)


def _metadata(fmt: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, str) or len(raw) > MAX_METADATA_CHARS:
        raise ValueError(f"metadata is not a base64 string of at most {MAX_METADATA_CHARS} "
                         "characters")
    try:
        blob = base64.b64decode(raw, validate=True)
    except binascii.Error:
        raise ValueError("metadata is not base64") from None
    try:
        got, meta = MD.decode(blob)
    except BadRequest as exc:
        raise ValueError(exc.message) from None
    if got != fmt:
        raise ValueError(f"metadata is of a {got} model, the manifest's is {fmt}")
    return meta


def _tensor(fname: str, fsize: int, i: int, t: Any) -> HashedTensor:
    where = f"{fname}: tensor {i}"
    if not isinstance(t, list) or len(t) != 9:
        raise ValueError(f"{where} is not [name, dtype, source_dtype, shape, logical_shape, "
                         "offset, nbytes, xxh3-128, xxh3-64]")
    name = _str(t[0], f"{where}'s name")
    where = f"{fname}: tensor {name[:80]!r}"
    dtype = _str(t[1], f"{where}'s dtype")
    try:
        itemsize = np_dtype(dtype).itemsize
    except BadRequest as exc:
        raise ValueError(f"{where}: {exc.message}") from None
    source = t[2]
    if not isinstance(source, str) or not P.source_type_ok(source):
        raise ValueError(f"{where}'s source dtype is not 1 to {P.MAX_SOURCE_TYPE} of "
                         "[A-Za-z0-9_]")
    dims = _shape(t[3], f"{where}'s shape")
    logical = None if t[4] is None else _shape(t[4], f"{where}'s logical shape")
    offset, nbytes = _int(t[5], f"{where}'s offset"), _int(t[6], f"{where}'s size")
    if math.prod(dims) * itemsize != nbytes:  # Python ints: no overflow
        raise ValueError(f"{where}: shape {list(dims)} of {dtype} is not {nbytes} bytes")
    if offset + nbytes > fsize:
        raise ValueError(f"{where}: bytes [{offset}, {offset + nbytes}) run past the file's "
                         f"{fsize} bytes")
    if not isinstance(t[7], str) or len(t[7]) != 32:
        raise ValueError(f"{where}'s xxh3-128 is not 32 hex digits")
    digest = int(t[7], 16)  # ValueError for a non-hex digit
    checksum = t[8]
    if not isinstance(checksum, int) or isinstance(checksum, bool) \
            or not 0 <= checksum < 1 << 64:
        raise ValueError(f"{where}'s xxh3-64 is not an integer in [0, 2**64)")
    return HashedTensor(name, dtype, source, dims, offset, nbytes, digest, checksum, logical)


def _shape(shape: Any, what: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > P.MAX_NDIM:
        raise ValueError(f"{what} is not a list of at most {P.MAX_NDIM} dimensions")
    dims = tuple(_int(d, what) for d in shape)
    if math.prod(dims) > P.MAX_INT:
        raise ValueError(f"{what} holds 2**63 elements or more")
    return dims


def check_against(hm: HashedModel, model: ModelFile) -> None:
    """The same files and sizes, every tensor at the same bytes as ``model``'s
    header now.  Raises BAD_REQUEST naming the first difference."""
    stale = f"{hm.path} does not match {model.path}"
    again = f"; run 'rpcbuf hash {model.path}' again"
    if [f.name for f in hm.files] != [f.name for f in model.files]:
        raise BadRequest(f"{stale}: it lists other files{again}", {"file": str(hm.path)})
    for hf, mf in zip(hm.files, model.files, strict=True):
        size = os.stat(mf).st_size
        if hf.size != size:
            raise BadRequest(f"{stale}: {mf.name} is {size} bytes, the manifest says "
                             f"{hf.size}{again}", {"file": str(hm.path)})
    listed = {t.name: (k, t) for k, t in hm.tensors}
    for spec in model.tensors:
        k, offset = model.where(spec.name)
        got = listed.pop(spec.name, None)
        if got is None or got[0] != k or got[1].file_offset != offset \
                or got[1].nbytes != spec.nbytes or got[1].dtype != spec.dtype \
                or got[1].source != spec.source:
            raise BadRequest(f"{stale}: tensor {spec.name!r} is not as the manifest says"
                             f"{again}", {"file": str(hm.path), "tensor": spec.name})
    if listed:
        extra = next(iter(listed))
        raise BadRequest(f"{stale}: it lists tensor {extra!r}, which the model does not have"
                         f"{again}", {"file": str(hm.path), "tensor": extra})


def describe(path: str | Path, use_cache: bool = True) -> HashedModel:
    """What a node-local load needs of ``path``: a hash manifest; a model with
    its manifest (checked against the header); else hashes read from the model (or
    the hash cache).  Blocking.  Raises BAD_REQUEST; OSError for a missing file."""
    p = Path(path)
    if is_manifest(p):
        return read_manifest(p)
    model = open_model(p)
    try:
        beside = manifest_path(p)
        if beside.exists():
            hm = read_manifest(beside)
            check_against(hm, model)
            hm.path = p
            hm.metadata = model.metadata
            return hm
        return hash_model(model, use_cache)
    finally:
        model.close()
