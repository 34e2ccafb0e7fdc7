"""A model file's own metadata, read within bounds (``modelcheck``, ``modelfile``),
stored as a blob (``metadata.encode``) and read back from an untrusted daemon
(``metadata.decode``, ``info.parse_tensors``), with no daemon: files written
by gguf-py and by hand, blobs and answers built to lie."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from models import write_raw_safetensors
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.models import metadata as MD
from rpcbuf.models.info import parse_tensors, slot_of
from rpcbuf.models.modelcheck import (
    MAX_METADATA_BYTES,
    MAX_METADATA_ITEMS,
    MAX_METADATA_KEYS,
    MAX_NAME,
    check_gguf,
)
from rpcbuf.models.modelfile import open_model

FAST = 0.5  # seconds: refused at the length, not after reading
U8, U32, STRING, ARRAY = 0, 4, 8, 9


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def gguf_head(kvs: bytes, n_kv: int, infos: bytes = b"", n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + infos


def refused(path: Path, *fragments: str, within: float = FAST) -> BadRequest:
    t0 = time.perf_counter()
    with pytest.raises(BadRequest) as info:
        open_model(path)
    took = time.perf_counter() - t0
    assert took < within, f"{path.name}: refused only after {took:.2f} s"
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return info.value


# -- GGUF key/values --------------------------------------------------------------------

KVS: dict[str, Any] = {
    "general.name": "tiny llama ✓", "x.u32": 7, "x.i8": -100, "x.u8": 200, "x.u16": 60000,
    "x.i16": -3, "x.i32": -70000, "x.u64": (1 << 64) - 1, "x.i64": -(1 << 62),
    "x.f32": 0.25, "x.f64": 1e-5, "x.true": True, "x.false": False,
    "tokenizer.ggml.tokens": ["<s>", "</s>", "héllo", ""], "x.scores": [0.5, -1.5],
    "x.flags": [True, False, True], "x.nested": [[1, 2], [3]],
}


def write_typed_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("general.name", KVS["general.name"])
    w.add_uint32("x.u32", 7)
    w.add_int8("x.i8", -100)
    w.add_uint8("x.u8", 200)
    w.add_uint16("x.u16", 60000)
    w.add_int16("x.i16", -3)
    w.add_int32("x.i32", -70000)
    w.add_uint64("x.u64", (1 << 64) - 1)
    w.add_int64("x.i64", -(1 << 62))
    w.add_float32("x.f32", 0.25)
    w.add_float64("x.f64", 1e-5)
    w.add_bool("x.true", True)
    w.add_bool("x.false", False)
    w.add_array("tokenizer.ggml.tokens", KVS["tokenizer.ggml.tokens"])
    w.add_array("x.scores", KVS["x.scores"])
    w.add_array("x.flags", KVS["x.flags"])
    w.add_array("x.nested", KVS["x.nested"])
    w.add_tensor("t", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_key_values_read_as_plain_python(tmp_path: Path) -> None:
    import gguf

    path = write_typed_gguf(tmp_path / "typed.gguf")
    meta = open_model(path).metadata
    assert meta == {"general.architecture": "llama", **KVS}
    assert type(meta["x.true"]) is bool and type(meta["x.u8"]) is int
    assert type(meta["x.scores"][0]) is float and type(meta["x.flags"][0]) is bool
    # the gguf package agrees (its contents() flattens arrays of arrays: left out)
    reader = gguf.GGUFReader(str(path))
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert {k: v for k, v in meta.items() if k != "x.nested"} == \
        {k: v for k, v in theirs.items() if k != "x.nested"}
    # and the blob load_model stores gives it back whole
    assert MD.decode(MD.encode("gguf", meta)) == ("gguf", meta)


@pytest.mark.timeout(30)
def test_an_array_of_too_many_entries_is_refused_at_its_length(tmp_path: Path) -> None:
    n = MAX_METADATA_ITEMS + 1  # 2 MiB of u8: fits the file, not rpcbuf's bound
    body = gguf_head(gstr(b"big") + struct.pack("<IIQ", ARRAY, U8, n) + bytes(n), 1)
    (p := tmp_path / "items.gguf").write_bytes(body)
    refused(p, f"more than {MAX_METADATA_ITEMS} values", "'big'")
    most = MAX_METADATA_ITEMS - 1  # the key is a value too
    ok = gguf_head(gstr(b"big") + struct.pack("<IIQ", ARRAY, U8, most) + bytes(most), 1)
    (p := tmp_path / "just.gguf").write_bytes(ok)
    t0 = time.perf_counter()
    assert len(check_gguf(p)["big"]) == most  # (gguf's own reader takes 15 us an item)
    assert time.perf_counter() - t0 < 2


@pytest.mark.timeout(30)
def test_a_2_gib_string_is_refused_before_a_byte_of_it_is_read(tmp_path: Path) -> None:
    n = 2 << 30
    head = gguf_head(gstr(b"k") + struct.pack("<IQ", STRING, n), 1)
    p = tmp_path / "sparse.gguf"
    with open(p, "wb") as f:  # a sparse file: the string's 2 GiB are really there
        f.write(head)
        f.truncate(len(head) + n)
    refused(p, f"{MAX_METADATA_BYTES} bytes of metadata")


@pytest.mark.timeout(30)
def test_too_many_keys_duplicate_keys_and_long_tensor_names(tmp_path: Path) -> None:
    n = MAX_METADATA_KEYS + 1
    many = gguf_head(b"".join(gstr(b"k%d" % i) + struct.pack("<IB", U8, 0) for i in range(n)), n)
    (p := tmp_path / "keys.gguf").write_bytes(many)
    refused(p, f"{n} metadata entries", str(MAX_METADATA_KEYS))
    twice = gguf_head((gstr(b"k") + struct.pack("<IB", U8, 1)) * 2, 2)
    (p := tmp_path / "twice.gguf").write_bytes(twice)
    refused(p, "'k' appears twice")
    info = gstr(b"n" * (MAX_NAME + 1)) + struct.pack("<IQIQ", 1, 1, 0, 0)
    (p := tmp_path / "name.gguf").write_bytes(gguf_head(b"", 0, info, 1) + bytes(64))
    refused(p, "tensor name", f"at most {MAX_NAME}")


# -- safetensors __metadata__ -------------------------------------------------------------


def st_file(header: dict[str, Any], body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def test_safetensors_metadata_logical_shapes_and_shards(tmp_path: Path) -> None:
    bits = np.arange(12, dtype="<u2").tobytes()
    d = tmp_path / "shards"
    d.mkdir()
    header = {"__metadata__": {"format": "pt", "who": "a"},
              "w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
              "odd": {"dtype": "F4", "shape": [2, 4], "data_offsets": [24, 28]}}
    (d / "model-00001-of-00002.safetensors").write_bytes(st_file(header, bits + bytes(4)))
    (d / "model-00002-of-00002.safetensors").write_bytes(st_file(
        {"__metadata__": {"who": "b", "more": "yes"},
         "v": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)))
    m = open_model(d)
    assert m.metadata == {"format": "pt", "who": "a", "more": "yes"}  # the first shard wins
    by = m.by_name
    assert by["w"].source == ("BF16", (3, 4)) and by["w"].dtype == "<u2"
    assert by["odd"].source == ("F4", (2, 4)) and by["odd"].shape == (4,)  # raw bytes
    assert by["v"].source == ("F32", (1,))
    plain = open_model(write_raw_safetensors(tmp_path / "p.safetensors",
                                             {"a": ("F32", [2], bytes(8))}))
    assert plain.metadata == {}


@pytest.mark.timeout(60)
def test_safetensors_metadata_and_dtypes_are_bounded(tmp_path: Path) -> None:
    big = {"__metadata__": {"k": "x" * (MAX_METADATA_BYTES + 1)}}
    (p := tmp_path / "big.safetensors").write_bytes(st_file(big))
    # (a safetensors header is JSON: its 32 MiB are scanned and parsed first)
    refused(p, "__metadata__", str(MAX_METADATA_BYTES), within=10)
    keys = {"__metadata__": {f"k{i}": "" for i in range(MAX_METADATA_KEYS + 1)}}
    (p := tmp_path / "keys.safetensors").write_bytes(st_file(keys))
    refused(p, "__metadata__", str(MAX_METADATA_KEYS))
    for dtype in ("F8-E4M3", "", "x" * 33, "B\u00e916"):
        bad = {"t": {"dtype": dtype, "shape": [1], "data_offsets": [0, 1]}}
        (p := tmp_path / "dtype.safetensors").write_bytes(st_file(bad, b"\0"))
        refused(p, "dtype", "[A-Za-z0-9_]")
    dims = {"t": {"dtype": "U8", "shape": [1] * (P.MAX_NDIM + 1), "data_offsets": [0, 1]}}
    (p := tmp_path / "dims.safetensors").write_bytes(st_file(dims, b"\0"))
    refused(p, f"{P.MAX_NDIM + 1} dimensions")


# -- the blob: encode, and decode what a daemon hands back ---------------------------------


def _blob(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _env(meta: Any, fmt: Any = "gguf", version: Any = 1) -> bytes:
    return _blob({"rpcbuf_model_metadata": version, "format": fmt, "metadata": meta})


def test_encode_and_decode_round_trip() -> None:
    for fmt, meta in (("gguf", KVS), ("safetensors", {"format": "pt"}), ("gguf", {})):
        blob = MD.encode(fmt, meta)
        assert blob.dtype == np.uint8 and blob.ndim == 1
        assert MD.decode(blob) == (fmt, meta)
        assert MD.decode(blob.tobytes()) == (fmt, meta)
    with pytest.raises(BadRequest, match="unknown model format"):
        MD.encode("onnx", {})
    with pytest.raises(BadRequest, match="cannot be stored"):
        MD.encode("gguf", {"x": object()})


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _raw_deep(depth: int) -> bytes:
    """``{"a": [[...[1]...]]}`` in an envelope, ``depth`` arrays deep (msgpack's
    own packer stops at 512: written by hand)."""
    return (b"\x83" + _blob("rpcbuf_model_metadata") + b"\x01" + _blob("format")
            + _blob("gguf") + _blob("metadata") + b"\x81" + _blob("a")
            + b"\x91" * depth + b"\x01")


HOSTILE: dict[str, tuple[Any, str]] = {
    "not msgpack": (lambda: b"\xc1\xc1\xc1", "not msgpack"),
    "truncated": (lambda: _env({"a": "b"})[:-1], "not msgpack"),
    "extra data": (lambda: _env({}) + b"\x00", "not msgpack"),
    "not a map": (lambda: _blob([1, 2]), "not rpcbuf's metadata"),
    "other keys": (lambda: _blob({"rpcbuf_model_metadata": 1, "format": "gguf"}),
                   "not rpcbuf's metadata"),
    "version": (lambda: _env({}, version=2), "version 1"),
    "format": (lambda: _env({}, fmt="onnx"), "no known format"),
    "metadata a list": (lambda: _env([1]), "no map"),
    "int keys": (lambda: _env({1: 2}), "not msgpack"),
    "a map value": (lambda: _env({"a": {"b": 1}}), "type dict"),
    "a null": (lambda: _env({"a": None}), "type NoneType"),
    "bytes": (lambda: _env({"a": b"\x00"}), "not msgpack"),
    "nested too deep": (lambda: _env({"a": _deep(9)}), "more than 8 deep"),
    "nested 9 by hand": (lambda: _raw_deep(9), "more than 8 deep"),
    "nested 100000 deep": (lambda: _raw_deep(100_000), "not msgpack"),
    "too many values": (lambda: _env({"a": [[0] * 1024] * (MAX_METADATA_ITEMS // 1024 + 1)}),
                        f"more than {MAX_METADATA_ITEMS} values"),
    "one huge array": (lambda: _env({"a": [0] * (MAX_METADATA_ITEMS + 1)}), "not msgpack"),
    "a huge string": (lambda: _env({"a": "x" * (MAX_METADATA_BYTES + 1)}), "not msgpack"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lie", list(HOSTILE))
def test_a_hostile_blob_is_one_bad_answer(lie: str) -> None:
    build, fragment = HOSTILE[lie]
    blob = build()
    t0 = time.perf_counter()
    with pytest.raises(BadRequest) as info:
        MD.decode(blob)
    assert time.perf_counter() - t0 < 2
    assert info.value.details == {"field": "metadata", "reason": "bad_answer"}
    assert fragment in info.value.message and "\n" not in info.value.message
    assert MD.decode(_raw_deep(8))[1] == {"a": _deep(8)}  # the deepest that is allowed


def test_a_blob_past_max_blob_is_refused_unread() -> None:
    with pytest.raises(BadRequest, match=f"at most {MD.MAX_BLOB}"):
        MD.decode(bytes(MD.MAX_BLOB + 1))


# -- the daemon's manifest, as model_info reads it ----------------------------------------

GOOD = {"dtype": "|u1", "shape": [2, 34], "offset": 0, "nbytes": 68, "checksum": 5,
        "source_type": "Q8_0", "logical_shape": [2, 32]}


def test_parse_tensors_reads_entries_in_offset_order() -> None:
    got = parse_tensors({"b": {**GOOD, "offset": 256}, "a": GOOD,
                         "c": {"dtype": "<f4", "shape": [2], "offset": 512, "nbytes": 8,
                               "checksum": None}}, 3, "b-1", 1024)
    assert [t.name for t in got] == ["a", "b", "c"]
    a = got[0]
    assert (a.slot, a.buffer_id, a.dtype, a.shape, a.source_type, a.logical_shape) == (
        3, "b-1", "|u1", (2, 34), "Q8_0", (2, 32))
    assert a.entry == GOOD
    assert got[2].source_type is None and got[2].logical_shape is None
    assert "source_type" not in got[2].entry


@pytest.mark.parametrize(("change", "field"), [
    ({"offset": 1000}, "tensors.offset"), ({"offset": -1}, "tensors.offset"),
    ({"nbytes": "68"}, "tensors.offset"), ({"offset": True}, "tensors.offset"),
    ({"dtype": "O"}, "tensors.dtype"), ({"dtype": "nonsense"}, "tensors.dtype"),
    ({"dtype": 4}, "tensors.dtype"), ({"dtype": "<f4" * 100}, "tensors.dtype"),
    ({"shape": [2, 35]}, "tensors.shape"), ({"shape": [1] * 40}, "tensors.shape"),
    ({"shape": "2,34"}, "tensors.shape"), ({"shape": [2.0, 34]}, "tensors.shape"),
    ({"checksum": -1}, "tensors.checksum"), ({"checksum": 1 << 64}, "tensors.checksum"),
    ({"source_type": "Q8-0"}, "tensors.source_type"), ({"source_type": 8}, "tensors.source_type"),
    ({"logical_shape": [1] * 33}, "tensors.logical_shape"),
    ({"logical_shape": 5}, "tensors.logical_shape"),
    ({"logical_shape": [-2]}, "tensors.logical_shape"),
])
def test_parse_tensors_refuses_a_lying_entry(change: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_tensors({"a": {**GOOD, **change}}, 0, "b-1", 1024)
    assert info.value.details == {"field": field, "reason": "bad_answer"}


def test_parse_tensors_refuses_a_manifest_that_is_no_map() -> None:
    for bad in (None, [GOOD], {"a": [1]}, {5: GOOD}):
        with pytest.raises(BadRequest) as info:
            parse_tensors(bad, 0, "b-1", 1024)
        assert info.value.details["reason"] == "bad_answer"


def test_the_manifest_cache_refuses_entries_that_are_no_entries() -> None:
    from rpcbuf.control.client.tensorops import TensorOps

    ops = TensorOps(None, None)  # type: ignore[arg-type]  # remember() is synchronous: no I/O
    meta = {"manifest_version": 1, "tensors_end": 256}
    ops.remember("b-1", {**meta, "tensors": {"a": GOOD}})
    assert ops.manifests["b-1"].table["a"] == GOOD
    for bad in ({"a": {**GOOD, "logical_shape": 5}}, {"a": {**GOOD, "shape": None}},
                {"a": {"dtype": "<f4"}}, {"a": [1]}, {"a": {**GOOD, "offset": "x"}},
                {"a": {**GOOD, "nbytes": 1 << 70}}):
        with pytest.raises(BadRequest) as info:
            ops.remember("b-2", {**meta, "tensors": bad})
        assert info.value.details == {"field": "tensors", "reason": "bad_answer"}
    assert "b-2" not in ops.manifests


def test_slot_of() -> None:
    assert slot_of("llama", "llama/slot12") == 12
    assert slot_of("llama", "llama/slot") is None
    assert slot_of("llama", "llama-2/slot0") is None
    assert slot_of("l.a", "lxa/slot0") is None  # the name is literal, not a pattern
    assert slot_of("llama", None) is None
    assert slot_of("llama", "llama/slot" + "9" * 10) is None  # bounded
