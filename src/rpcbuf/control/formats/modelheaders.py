"""Model file headers (GGUF, safetensors) walked and checked against the file
before anything parses them.

A header is hostile input made of counts, lengths and offsets.  Each is checked
against the bytes the file really has before it is used (a count against what
the rest of the file could hold at the smallest item size, so no loop outruns
the file), nesting is bounded by what the format allows, and the model's own
metadata by ``MAX_METADATA_*``.  Only a header that passed goes on to the
format's own package.  Whatever is wrong is one ``Malformed``.

No I/O: the walks take the header's bytes, or (GGUF) a ``pread``-like function
and the file's size, so client and daemon share them.  Never a memory map: a
file truncated during the walk would SIGBUS; a short read is "the file shrank".
The GGUF walk reads a window at a time, at most the metadata and tensor-info
bounds of any file.  Both formats also yield each tensor's byte range, the only
ranges the daemon loads.

- GGUF v2/v3, either byte order: every key and value (nested at most
  ``GGUF_MAX_NESTING``), ``general.alignment``, and each tensor's name (at most
  ``MAX_NAME`` bytes), dims (at most 4), known type, aligned offset and a byte
  range within the file.  ``gguf_ranges`` walks past values without building them.
- safetensors: header length within the file and ``ST_MAX_HEADER``, at most 3
  levels of nesting, ``__metadata__`` strings only, each entry's ``dtype`` (1-32
  of ``[A-Za-z0-9_]``), ``shape`` (at most 32 dims) and ordered ``data_offsets``
  within the file, exactly the shape's bytes for a dtype of known size.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rpcbuf.control.wire import protocol as P

GGUF_MAX_NESTING = 8  # arrays of arrays: real files use 1 or 2
GGML_MAX_DIMS = 4
ST_MAX_HEADER = 100 << 20
_ST_LEVELS = 3
MAX_NAME = P.MAX_STR  # bytes of a tensor name (the wire takes at most this many characters)
# A model file's own metadata (GGUF key/values, safetensors __metadata__).
# Real files hold tens of keys and a tokenizer of a few MiB (Llama 3: about
# 540,000 array items, 8 MiB; the largest vocabularies about twice that).
MAX_METADATA_KEYS = 1 << 16
MAX_METADATA_ITEMS = 1 << 21  # keys and values, array items counted one by one
MAX_METADATA_BYTES = 32 << 20  # of the file: GGUF's key/value section, __metadata__'s text
# GGUF's tensor infos: real files list a few thousand (a name, a shape, a
# type, an offset: about 100 bytes each).
MAX_TENSORS = 1 << 20
MAX_TENSOR_INFO_BYTES = 64 << 20
_WINDOW = 1 << 20  # bytes of a GGUF header read at once

# GGUF value types: fixed-size scalars by type number; 8 is STRING, 9 ARRAY.
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q",
               11: "q", 12: "d"}  # struct/NumPy codes (bool: a byte, nonzero is true)
_BOOL = 7
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_VALUE = 1  # the smallest value a metadata entry can have (a u8 or a bool)
_MIN_KV = 8 + 4 + _MIN_VALUE  # key length, value type, value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


def _short(name: bytes | str) -> str:  # attacker-chosen, so bounded
    text = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
    return repr(text if len(text) <= 80 else text[:77] + "...")


class Malformed(Exception):
    """What is wrong with a header (the caller names the file).

    ``str()`` names the check and at most the file's size, never a value read
    from it: whoever asks the daemon to load a file must learn nothing of its
    bytes.  ``detail`` adds names and values, for the file's owner."""

    def __init__(self, public: str, detail: str | None = None) -> None:
        super().__init__(public)
        self.detail = public if detail is None else detail


Ranges = dict[str, tuple[int, int]]  # tensor name -> [start, stop) in the file


Read = Callable[[int, int], bytes]  # (offset, n) -> the file's bytes there, at most n


class _GgufReader:
    """Reads a GGUF header through ``read``, a window at a time, refusing any
    read past the file's end or ``bound``."""

    def __init__(self, read: Read, size: int, order: str, keep: bool) -> None:
        self._read = read
        self.size = size
        self.pos = 0
        self.order = order
        self.keep = keep  # build the metadata values (else only walk past them)
        self.bound: tuple[int, str] | None = None  # (end, why): no read may pass it
        self.items = MAX_METADATA_ITEMS  # metadata values still allowed
        self._window = b""
        self._at = 0  # where the window starts in the file

    def left(self) -> int:
        return self.size - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise Malformed(f"its header runs past the end of the file ({self.size} bytes)",
                            f"{what} at byte {self.pos} ({n} bytes) runs past the end of the "
                            f"file ({self.size} bytes)")
        if self.bound is not None and self.pos + n > self.bound[0]:
            raise Malformed(f"its header {self.bound[1]}",
                            f"{what} at byte {self.pos} ({n} bytes) {self.bound[1]}")
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        start = self.pos
        self.skip(n, what)  # checked against the file and the bound before any read
        i = start - self._at
        if i < 0 or i + n > len(self._window):
            self._at, i = start, 0
            self._window = self._read(start, min(max(n, _WINDOW), self.size - start))
            if len(self._window) < n:
                raise Malformed(f"the file shrank while its header was read ({self.size} "
                                "bytes before)")
        return self._window[i:i + n]

    def uint(self, width: int, what: str) -> int:
        fmt = {4: "I", 8: "Q"}[width]
        return int(struct.unpack(self.order + fmt, self.take(width, what))[0])

    def string(self, what: str) -> bytes:
        return self.take(self.uint(8, f"length of {what}"), what)

    def skip_strings(self, n: int, what: str) -> None:
        """Walk past ``n`` strings at their lengths (a vocabulary: a million of
        them, so no call per item while the length is in the window)."""
        code = struct.Struct(self.order + "Q")
        for _ in range(n):
            i = self.pos - self._at
            if 0 <= i and i + 8 <= len(self._window):
                (length,) = code.unpack_from(self._window, i)
                self.skip(8, what)
            else:
                length = self.uint(8, what)
            self.skip(length, what)

    def count(self, n: int, least: int, what: str) -> None:
        """``n`` items of at least ``least`` bytes each must fit in what is left."""
        if n > self.left() // least:
            raise Malformed(f"a count in its header cannot fit in the file ({self.size} bytes)",
                            f"{what} at byte {self.pos} cannot fit in the {self.left()} bytes "
                            f"left of the file ({self.size} bytes)")

    def values(self, n: int, what: str) -> None:
        if n > self.items:
            raise Malformed(f"its metadata would hold more than {MAX_METADATA_ITEMS} values (the "
                            "most rpcbuf reads)",
                            f"{what} at byte {self.pos}: the metadata would hold more than "
                            f"{MAX_METADATA_ITEMS} values (the most rpcbuf reads)")
        self.items -= n


def gguf_ranges(read: Read, size: int) -> Ranges:
    """Where each tensor's bytes lie, the key/values walked past, not built."""
    return _walk(_GgufReader(read, size, "<", keep=False))[0]


def gguf_walk(read: Read, size: int) -> tuple[Ranges, dict[str, Any]]:
    """Each tensor's byte range and the key/values as plain Python.
    Raises ``Malformed`` (a file that shrank while read, too)."""
    return _walk(_GgufReader(read, size, "<", keep=True))


def _walk(cur: _GgufReader) -> tuple[Ranges, dict[str, Any]]:
    from gguf.constants import GGML_QUANT_SIZES

    if cur.take(4, "magic") != b"GGUF":
        raise Malformed("no GGUF magic")
    version = cur.uint(4, "version")
    if version & 0xFFFF == 0 and version:  # written on a big-endian machine
        cur.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise Malformed("a GGUF version this reader does not know (it knows 2 and 3)",
                        f"GGUF version {version} (this reader knows versions 2 and 3)")
    n_tensors = cur.uint(8, "tensor count")
    n_kv = cur.uint(8, "metadata count")
    cur.count(n_kv, _MIN_KV, f"{n_kv} metadata entries")
    cur.count(n_tensors, _MIN_TENSOR_INFO, f"{n_tensors} tensors")
    if n_kv > MAX_METADATA_KEYS:
        raise Malformed(f"more than {MAX_METADATA_KEYS} metadata entries (the most rpcbuf "
                        "reads)", f"{n_kv} metadata entries (rpcbuf reads at most "
                        f"{MAX_METADATA_KEYS})")
    if n_tensors > MAX_TENSORS:
        raise Malformed(f"more than {MAX_TENSORS} tensors (the most rpcbuf reads)",
                        f"{n_tensors} tensors (rpcbuf reads at most {MAX_TENSORS})")
    cur.bound = (cur.pos + MAX_METADATA_BYTES, f"passes the {MAX_METADATA_BYTES} bytes of "
                                               "metadata rpcbuf reads")
    alignment = 32
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.uint(4, f"type of {_short(key)}")
        text = key.decode("utf-8", "replace")
        if text in meta:
            raise Malformed("a metadata key appears twice",
                            f"metadata key {_short(key)} appears twice")
        cur.values(1, f"metadata key {_short(key)}")
        if key == b"general.alignment":
            if vtype != _UINT32:
                raise Malformed("general.alignment is not a uint32",
                                f"general.alignment has value type {vtype}, not uint32")
            alignment = meta[text] = cur.uint(4, "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise Malformed("general.alignment is not a power of two",
                                f"alignment {alignment} is not a power of two")
            continue
        meta[text] = _gguf_value(cur, vtype, _short(key), 0)
    cur.bound = (cur.pos + MAX_TENSOR_INFO_BYTES, f"passes the {MAX_TENSOR_INFO_BYTES} bytes "
                                                  "of tensor infos rpcbuf reads")
    quant = {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}
    infos: list[tuple[str, int, int]] = []  # name, offset, bytes
    raws: list[bytes] = []
    names: set[bytes] = set()
    for _ in range(n_tensors):
        n = cur.uint(8, "length of tensor name")
        if n > MAX_NAME:
            raise Malformed(f"a tensor name is longer than {MAX_NAME} bytes",
                            f"a tensor name at byte {cur.pos} of {n} bytes (at most "
                            f"{MAX_NAME})")
        raw = cur.take(n, "tensor name")
        name = _short(raw)
        if raw in names:
            raise Malformed("a tensor name appears twice", f"tensor {name} appears twice")
        names.add(raw)
        raws.append(raw)
        n_dims = cur.uint(4, f"dimension count of tensor {name}")
        if n_dims > GGML_MAX_DIMS:
            raise Malformed(f"a tensor has more than {GGML_MAX_DIMS} dimensions",
                            f"tensor {name} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        dims = [cur.uint(8, f"dimension of tensor {name}") for _ in range(n_dims)]
        ttype = cur.uint(4, f"type of tensor {name}")
        if ttype not in quant:
            raise Malformed("a tensor has an unknown tensor type",
                            f"tensor {name} has unknown tensor type {ttype}")
        offset = cur.uint(8, f"offset of tensor {name}")
        block, type_size = quant[ttype]
        elements = 1
        for d in dims:
            elements *= d  # Python ints: no overflow to hide a huge shape
        if dims and dims[0] % block:
            raise Malformed("a tensor's rows are not whole blocks of its type",
                            f"tensor {name}: {dims[0]} elements per row is not a multiple of "
                            f"its type's block of {block}")
        if offset % alignment:
            raise Malformed("a tensor's offset is not aligned",
                            f"tensor {name}: offset {offset} is not aligned to {alignment}")
        infos.append((name, offset, elements // block * type_size))
    cur.bound = None
    start = cur.pos + -cur.pos % alignment
    out: Ranges = {}
    for (name, offset, nbytes), raw in zip(infos, raws, strict=True):
        if start + offset + nbytes > cur.size:
            raise Malformed(f"a tensor runs past the end of the file ({cur.size} bytes)",
                            f"tensor {name}: its {nbytes} bytes at byte {start + offset} run "
                            f"past the end of the file ({cur.size} bytes)")
        out[raw.decode("utf-8", "replace")] = (start + offset, start + offset + nbytes)
    return out, meta


def _gguf_value(cur: _GgufReader, vtype: int, key: str, depth: int) -> Any:
    """One metadata value; every length is checked before its bytes are read."""
    size = _GGUF_SCALARS.get(vtype)
    if size is not None and not cur.keep:
        return cur.skip(size, f"value of {key}")
    if size is not None:
        raw = cur.take(size, f"value of {key}")
        value = struct.unpack(cur.order + _GGUF_CODES[vtype], raw)[0]
        return value != 0 if vtype == _BOOL else value
    if vtype == _STRING and not cur.keep:
        return cur.skip(cur.uint(8, f"length of string of {key}"), f"string of {key}")
    if vtype == _STRING:
        return cur.string(f"string of {key}").decode("utf-8", "replace")
    if vtype == _ARRAY:
        if depth >= GGUF_MAX_NESTING:
            raise Malformed(f"metadata arrays nest more than {GGUF_MAX_NESTING} deep",
                            f"{key}: arrays nested more than {GGUF_MAX_NESTING} deep")
        itype = cur.uint(4, f"item type of {key}")
        n = cur.uint(8, f"length of {key}")
        if itype not in _GGUF_SCALARS and itype not in (_STRING, _ARRAY):
            raise Malformed("a metadata array of unknown value type",
                            f"{key}: array of unknown value type {itype}")
        least = _GGUF_SCALARS.get(itype) or (8 if itype == _STRING else 4 + 8)
        cur.count(n, least, f"{key}: array of {n} items")
        cur.values(n, f"{key}: array of {n} items")
        if itype in _GGUF_SCALARS and not cur.keep:
            return cur.skip(n * least, f"items of {key}")
        if itype in _GGUF_SCALARS:
            raw = cur.take(n * least, f"items of {key}")
            items = np.frombuffer(raw, dtype=cur.order + _GGUF_CODES[itype])
            return (items != 0).tolist() if itype == _BOOL else items.tolist()
        # bounded: n items of >= 8 bytes fit in the file, n values in the budget
        if not cur.keep and itype == _STRING:
            cur.skip_strings(n, f"a string of {key}")
            return None
        if not cur.keep:
            for _ in range(n):
                _gguf_value(cur, itype, key, depth + 1)
            return None
        return [_gguf_value(cur, itype, key, depth + 1) for _ in range(n)]
    raise Malformed("a metadata value of unknown type", f"{key} has unknown value type {vtype}")


# A JSON string (escapes included), then everything but brackets: what is
# left of a header is its bracket structure, at C speed even for 100 MiB.
# The pattern matches from every quote without backtracking (an unterminated
# string, even one ending in a lone backslash, runs to the end of the text):
# a pattern that can fail is retried from each escaped quote inside the
# string, quadratic in ``"\"\"\"...`` (20,000 of them took 7 s).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.?[^"\\]*)*(?:"|\Z)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def nesting_within(raw: bytes, levels: int) -> bool:
    """Whether JSON ``raw`` nests at most ``levels`` deep with balanced brackets:
    each pass strips the innermost pairs.  Linear, never recursive."""
    shape = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(levels):
        shape = _INNERMOST.sub(b"", shape)
    return not shape


def safetensors_length(first: bytes, size: int) -> int:
    """The header length from the first 8 bytes, within the file and
    ``ST_MAX_HEADER``.  Raises ``Malformed`` (never quoting the 8 bytes)."""
    if size < 8 or len(first) < 8:
        raise Malformed(f"{size} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", first[:8])
    # Never the length itself in a message: on a file that is no model it
    # is the file's first 8 bytes (a ``.env``'s "HF_TOKEN").
    if n > size - 8:
        raise Malformed(f"not a safetensors header: its first 8 bytes are no header length "
                        f"within the file's {size} bytes")
    if n > ST_MAX_HEADER:
        raise Malformed(f"its header is longer than {ST_MAX_HEADER} bytes (the most rpcbuf "
                        "reads)")
    return int(n)


def safetensors_parse(raw: bytes, size: int, itemsizes: Mapping[str, int]
                      ) -> tuple[int, dict[str, Any]]:
    """``(data start, header)`` from the header's bytes, every entry checked
    against the file; a dtype in ``itemsizes`` must match its shape's bytes.
    Raises ``Malformed``."""
    n = len(raw)
    if not nesting_within(raw, _ST_LEVELS):
        raise Malformed(f"its JSON header nests deeper than the {_ST_LEVELS} levels the format "
                         "has, or its brackets do not balance")
    try:
        header = json.loads(raw)
    except UnicodeDecodeError as exc:  # its message quotes the byte
        raise Malformed("its header is not UTF-8", f"its header is not UTF-8 (at byte "
                        f"{8 + exc.start})") from None
    except json.JSONDecodeError as exc:  # its message says where, never what
        raise Malformed("its header is not JSON", f"its header is not JSON: {exc.msg} "
                        f"(at byte {8 + exc.pos})") from None
    except ValueError:  # too many digits
        raise Malformed("its header is not JSON (a number too long to read)") from None
    if not isinstance(header, dict):
        raise Malformed("its header is not a JSON object")
    room = size - 8 - n
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str)
                                                      for v in entry.values()):
                raise Malformed("__metadata__ is not an object of strings")
            continue
        _check_entry(_short(key), entry, room, 8 + n, itemsizes)
    return 8 + n, header


def safetensors_ranges(base: int, header: Mapping[str, Any]) -> Ranges:
    return {k: (base + int(e["data_offsets"][0]), base + int(e["data_offsets"][1]))
            for k, e in header.items() if k != "__metadata__"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(name: str, entry: Any, room: int, base: int, itemsizes: Mapping[str, int]
                 ) -> None:
    def bad(what: str, detail: str) -> Malformed:  # public: no name, no value of the file
        return Malformed(f"a tensor entry {what}", f"tensor {name}{detail}")

    if not isinstance(entry, dict):
        raise bad("is not a JSON object", " is not a JSON object")
    if not isinstance(entry.get("dtype"), str):
        raise bad("has no string dtype", " has no string dtype")
    if not P.source_type_ok(entry["dtype"]):
        raise bad(f"has a dtype that is not 1 to {P.MAX_SOURCE_TYPE} of [A-Za-z0-9_]",
                  f": dtype {_short(entry['dtype'])} is not 1 to {P.MAX_SOURCE_TYPE} of "
                  "[A-Za-z0-9_]")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("has a shape that is not a list of non-negative integers",
                  ": shape is not a list of non-negative integers")
    if len(shape) > P.MAX_NDIM:
        raise bad(f"has more than {P.MAX_NDIM} dimensions",
                  f": {len(shape)} dimensions (at most {P.MAX_NDIM})")
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets)):
        raise bad("has no data_offsets [start, stop]", ": data_offsets is not [start, stop]")
    start, stop = offsets
    if not 0 <= start <= stop:
        raise bad("has data_offsets out of order",
                  f": data_offsets [{start}, {stop}] are not in order")
    if stop > room:
        raise bad(f"runs past the end of the file ({base + room} bytes)",
                  f": bytes [{start}, {stop}) after the header (at byte {base}) run past the "
                  f"end of the file ({base + room} bytes)")
    itemsize = itemsizes.get(entry["dtype"])
    if itemsize is not None and math.prod(shape) * itemsize != stop - start:  # Python ints
        raise bad("has more or fewer bytes than its shape and dtype take",
                  f" has {stop - start} bytes, not {shape} x {_short(entry['dtype'])}")
