"""Model files: a safetensors or GGUF model's tensors, read a batch at a time.

``open_model`` reads only the header: each tensor's name, dtype, shape, size,
``source_dtype`` and ``logical_shape``, and the file's metadata (bounded).
``ModelFile.read(names)`` returns NumPy views of a read-only memory map (no
copy; ``get_tensor``'s copies were 2-3x slower), so a loader holds one batch,
not the model.  NumPy has no bfloat16 or float8: those are their raw bits
(``<u2``/``|u1``).  Quantized GGUF tensors are the reader's uint8 rows (a Q8_0
(512, 256) is (512, 272)).  A directory of safetensors shards is one model,
its ``__metadata__`` merged (first shard wins).  ``read`` is thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.models.modelcheck import (
    MAX_METADATA_BYTES,
    MAX_METADATA_KEYS,
    check_gguf,
    metadata_of_safetensors,
    safetensors_header,
)

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
              "I16": "<i2", "I8": "|i1", "U8": "|u1", "U16": "<u2", "U32": "<u4",
              "U64": "<u8", "BOOL": "|b1", "C64": "<c8"}
_ST_RAW = {"BF16": "<u2", "F8_E4M3": "|u1", "F8_E5M2": "|u1", "F8_E4M3FN": "|u1",
           "F8_E5M2FNUZ": "|u1", "F8_E4M3FNUZ": "|u1", "F8_E8M0": "|u1"}
_ST_ITEMSIZE = {k: np.dtype(v).itemsize for k, v in {**_ST_DTYPES, **_ST_RAW}.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # the NumPy dtype the bytes are stored and recorded as
    shape: tuple[int, ...]
    nbytes: int
    source_dtype: str  # the file's own name for it (BF16, Q4_K, F16 ...)
    file: int = 0  # index into ModelFile.files
    logical_shape: tuple[int, ...] | None = None  # its elements, in NumPy order (None: shape)

    @property
    def source(self) -> tuple[str, tuple[int, ...]]:
        """``(source type, logical shape)`` beside the NumPy view."""
        return self.source_dtype, self.shape if self.logical_shape is None \
            else self.logical_shape


class ModelFile:
    def __init__(self, path: Path, fmt: str, files: list[Path],
                 tensors: list[TensorSpec], reader: Any = None,
                 metadata: dict[str, Any] | None = None) -> None:
        self.path = path
        self.format = fmt
        self.files = files
        self.tensors = tensors
        #: the file's own metadata: GGUF key/values, safetensors ``__metadata__``
        self.metadata: dict[str, Any] = metadata or {}
        self.by_name = {t.name: t for t in tensors}
        self._gguf = reader
        self._maps: dict[int, np.memmap] = {}
        self._raw_at: dict[str, tuple[int, int]] = {}
        self._gguf_at: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def read(self, names: list[str]) -> dict[str, np.ndarray]:
        """The named tensors as arrays (views of the memory map where possible)."""
        if self._gguf is not None:
            data = {t.name: t.data for t in self._gguf.tensors}
            return {n: np.asarray(data[n]) for n in names}
        return {n: self._raw(self.by_name[n]) for n in names}

    def where(self, name: str) -> tuple[int, int]:
        spec = self.by_name[name]
        if self._gguf is not None:
            if not self._gguf_at:
                self._gguf_at = {t.name: int(t.data_offset) for t in self._gguf.tensors}
            return spec.file, self._gguf_at[name]
        return spec.file, self._raw_at[name][0]

    def _raw(self, spec: TensorSpec) -> np.ndarray:
        if spec.file not in self._maps:
            self._maps[spec.file] = np.memmap(self.files[spec.file], dtype=np.uint8, mode="r")
        start, stop = self._raw_at[spec.name]
        return self._maps[spec.file][start:stop].view(spec.dtype).reshape(spec.shape)

    def close(self) -> None:
        self._maps.clear()
        self._gguf = None


def open_model(path: str | Path) -> ModelFile:
    """A GGUF file, a safetensors file, or a directory of shards.  Raises
    BAD_REQUEST (not a model, unreadable header); OSError when missing."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise BadRequest(f"{p} holds no *.safetensors files")
        return _open_safetensors(p, files)
    if not p.exists():
        raise FileNotFoundError(f"no such model file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _open_gguf(p)
    return _open_safetensors(p, [p])  # its header check says when it is neither


def _open_safetensors(root: Path, files: list[Path]) -> ModelFile:
    from safetensors import safe_open

    specs: list[TensorSpec] = []
    raw_at: dict[str, tuple[int, int]] = {}
    metadata: dict[str, str] = {}
    for idx, file in enumerate(files):
        base, header = safetensors_header(file, _ST_ITEMSIZE)  # checked against the file
        for k, v in metadata_of_safetensors(file, header).items():
            metadata.setdefault(k, v)
        if len(metadata) > MAX_METADATA_KEYS or \
                sum(len(k) + len(v) for k, v in metadata.items()) > MAX_METADATA_BYTES:
            raise BadRequest(f"{root}: the shards' __metadata__ together pass "
                             f"{MAX_METADATA_KEYS} keys or {MAX_METADATA_BYTES} characters",
                             {"file": str(file)})
        try:
            with safe_open(str(file), framework="np") as f:
                keys = list(f.keys())
                slices = {k: f.get_slice(k) for k in keys}
                meta = {k: (s.get_dtype(), tuple(int(d) for d in s.get_shape()))
                        for k, s in slices.items()}
        except Exception as exc:  # the Rust binding raises its own error types
            raise BadRequest(f"{file}: not a readable safetensors file: {exc}") from None
        order = sorted(keys, key=lambda k: header[k]["data_offsets"][0])  # file order
        for k in order:
            src, shape = meta[k]
            logical = shape
            start, stop = (int(x) for x in header[k]["data_offsets"])
            dtype = _ST_DTYPES.get(src) or _ST_RAW.get(src)
            if dtype is None:  # unknown to us: its bytes, as they are
                dtype, shape = "|u1", (stop - start,)
            nbytes = stop - start  # the shape's bytes: safetensors_header checked
            raw_at[k] = (base + start, base + stop)
            specs.append(TensorSpec(k, dtype, shape, nbytes, src, idx, logical))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise BadRequest(f"{root}: a tensor name appears in more than one shard")
    model = ModelFile(root, "safetensors", files, specs, metadata=metadata)
    model._raw_at = raw_at
    return model


def _open_gguf(path: Path) -> ModelFile:
    import gguf

    metadata = check_gguf(path)  # every count and length against the file, first
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # gguf raises ValueError and friends on a bad file
        raise BadRequest(f"{path}: not a readable GGUF file: {exc}") from None
    specs = [TensorSpec(t.name, t.data.dtype.str, tuple(int(d) for d in t.data.shape),
                        int(t.data.nbytes), t.tensor_type.name, 0,
                        tuple(int(d) for d in reversed(t.shape)))  # ggml lists ne[0] first
             for t in reader.tensors]
    return ModelFile(path, "gguf", [path], specs, reader, metadata)
