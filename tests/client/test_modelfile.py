"""Malicious and malformed model files (the third attacker: a hostile file).

Each file here is built by hand, byte by byte, to lie in its header: counts
and lengths far past the end of the file, nesting deeper than the format
has, files cut short.  ``open_model`` must refuse every one with a single
BAD_REQUEST that names the file and what is wrong, at once (the 49-byte GGUF
with an array count of 2^40 made the ``gguf`` reader loop for minutes; a
deeply nested safetensors header escaped as a ``RecursionError``), and
``rpcbuf load`` must exit 2 with one line and no traceback.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from models import gguf_tensors, write_gguf, write_raw_safetensors, write_safetensors
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.models.modelfile import open_model

FAST = 0.5  # seconds: "well under a second", with room for a busy 2-core machine

# GGUF value types (gguf.GGUFValueType) and tensor types used below.
U8, U32, STRING, ARRAY = 0, 4, 8, 9
F32 = 0


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def gguf_file(kvs: bytes = b"", n_kv: int = 0, infos: bytes = b"", n_tensors: int = 0,
              data: bytes = b"", version: int = 3) -> bytes:
    """A GGUF file from raw parts: header, metadata, tensor infos, padding, data
    (the padding to the default alignment of 32 only where data follows)."""
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs + infos
    return head + b"\0" * (-len(head) % 32) + data if data else head


def tensor_info(name: bytes, dims: list[int], ttype: int = F32, offset: int = 0) -> bytes:
    return (gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", ttype, offset))


def nested_arrays(depth: int) -> bytes:
    """A metadata value: ``depth`` arrays, each holding the next, then one u8."""
    out = struct.pack("<IQ", U8, 1) + b"\x07"
    for _ in range(depth - 1):
        out = struct.pack("<IQ", ARRAY, 1) + out
    return out


def refused(path: Path, *fragments: str) -> BadRequest:
    """open_model(path) raises one BAD_REQUEST naming the file, at once."""
    t0 = time.perf_counter()
    with pytest.raises(BadRequest) as info:
        open_model(path)
    took = time.perf_counter() - t0
    msg = str(info.value)
    assert took < FAST, f"{path.name}: refused only after {took:.2f} s"
    assert str(path) in msg and "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return info.value


@pytest.mark.timeout(20)
def test_gguf_array_count_of_2_40_in_49_bytes_is_refused_at_once(tmp_path: Path) -> None:
    body = gguf_file(gstr(b"a") + struct.pack("<IIQ", ARRAY, U8, 1 << 40), n_kv=1)
    assert len(body) == 49
    (p := tmp_path / "evil.gguf").write_bytes(body)
    refused(p, "array of 1099511627776", "49 bytes")


GGUF_LIES: dict[str, tuple[Callable[[], bytes], str]] = {
    "kv count": (lambda: gguf_file(n_kv=1 << 62), "metadata entries"),
    "tensor count": (lambda: gguf_file(n_tensors=1 << 62), "tensors"),
    "key length": (lambda: gguf_file(struct.pack("<Q", 1 << 63) + b"\0" * 16, n_kv=1),
                   "past the end"),
    "string length": (lambda: gguf_file(gstr(b"k") + struct.pack("<IQ", STRING, 1 << 40),
                                        n_kv=1), "past the end"),
    "string array": (lambda: gguf_file(gstr(b"k") + struct.pack("<IIQ", ARRAY, STRING,
                                                                1 << 50), n_kv=1), "array of"),
    "array of arrays": (lambda: gguf_file(gstr(b"k") + struct.pack("<IIQ", ARRAY, ARRAY,
                                                                   1 << 50), n_kv=1), "array of"),
    "nested arrays": (lambda: gguf_file(gstr(b"k") + struct.pack("<I", ARRAY)
                                        + nested_arrays(5000), n_kv=1), "nested"),
    "value type": (lambda: gguf_file(gstr(b"k") + struct.pack("<I", 99) + b"\0" * 8, n_kv=1),
                   "value type 99"),
    "alignment": (lambda: gguf_file(gstr(b"general.alignment") + struct.pack("<II", U32, 3),
                                    n_kv=1), "alignment"),
    "dims": (lambda: gguf_file(infos=tensor_info(b"t", [1] * 70000), n_tensors=1), "dimensions"),
    "tensor type": (lambda: gguf_file(infos=tensor_info(b"t", [4], ttype=9999), n_tensors=1),
                    "tensor type 9999"),
    "huge shape": (lambda: gguf_file(infos=tensor_info(b"t", [1 << 40] * 4), n_tensors=1,
                                     data=b"\0" * 64), "past the end"),
    "data past eof": (lambda: gguf_file(infos=tensor_info(b"t", [64]), n_tensors=1,
                                        data=b"\0" * 16), "past the end"),
    "offset past eof": (lambda: gguf_file(infos=tensor_info(b"t", [1], offset=1 << 60),
                                          n_tensors=1, data=b"\0" * 32), "past the end"),
    "version": (lambda: gguf_file(version=7), "version 7"),
    "header cut": (lambda: b"GGUF\x03\0\0\0\0\0", "past the end"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lie", list(GGUF_LIES))
def test_gguf_counts_and_lengths_are_checked_against_the_file(tmp_path: Path, lie: str) -> None:
    build, fragment = GGUF_LIES[lie]
    (p := tmp_path / "lie.gguf").write_bytes(build())
    refused(p, fragment)


@pytest.mark.timeout(60)
def test_gguf_cut_short_anywhere_is_refused(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "good.gguf", gguf_tensors(1, hidden=8, ffn=8, vocab=8))
    whole = good.read_bytes()
    model = open_model(good)
    end = max(o + t.nbytes for t in model.tensors for _, o in [model.where(t.name)])
    model.close()
    assert end > len(whole) - 32  # what follows is the writer's alignment padding
    cut = tmp_path / "cut.gguf"
    step = max(1, end // 150)  # about 150 cuts: header, metadata, infos, data
    for n in [*range(4, end, step), end - 1]:
        cut.write_bytes(whole[:n])
        refused(cut)


def st_file(header: bytes | str, body: bytes = b"") -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw)) + raw + body


@pytest.mark.timeout(20)
def test_safetensors_deeply_nested_header_is_refused_without_recursion(tmp_path: Path) -> None:
    deep = '{"t": {"dtype": "F32", "shape": ' + "[" * 200_000 + "]" * 200_000 + "}}"
    (p := tmp_path / "deep.safetensors").write_bytes(st_file(deep))
    refused(p, "nest")
    (p := tmp_path / "deep-objects.safetensors").write_bytes(
        st_file('{"a":' * 100_000 + "1" + "}" * 100_000))
    refused(p, "nest")


ST_LIES: dict[str, tuple[bytes, str]] = {
    "header length": (struct.pack("<Q", 1 << 62) + b"{}", "no header length"),
    "short": (b"\x02\0\0", "too short"),
    "not json": (st_file("{nope"), "JSON"),
    "not an object": (st_file("[1, 2]"), "object"),
    "entry not an object": (st_file('{"t": 5}'), "'t'"),
    "no offsets": (st_file('{"t": {"dtype": "F32", "shape": [1]}}'), "data_offsets"),
    "offsets past eof": (st_file('{"t": {"dtype": "F32", "shape": [1], '
                                 '"data_offsets": [0, 4096]}}', b"\0" * 4), "past the end"),
    "offsets reversed": (st_file('{"t": {"dtype": "F32", "shape": [1], '
                                 '"data_offsets": [4, 0]}}', b"\0" * 4), "data_offsets"),
    "negative dim": (st_file('{"t": {"dtype": "U8", "shape": [-4], '
                             '"data_offsets": [0, 4]}}', b"\0" * 4), "shape"),
    "overflowing shape": (st_file('{"t": {"dtype": "F64", "shape": [4294967296, 4294967296, '
                                  '1048576], "data_offsets": [0, 0]}}'), "bytes"),
    "bad metadata": (st_file('{"__metadata__": {"a": [1]}}'), "__metadata__"),
    "escaped quotes": (st_file(b'{"' + b'\\"' * 200_000), "balance"),  # no quadratic scan
    "huge number": (st_file('{"t": {"dtype": "U8", "shape": [' + "9" * 5000 + '], '
                            '"data_offsets": [0, 1]}}', b"\0"), "JSON"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lie", list(ST_LIES))
def test_safetensors_header_is_checked_against_the_file(tmp_path: Path, lie: str) -> None:
    body, fragment = ST_LIES[lie]
    (p := tmp_path / "lie.safetensors").write_bytes(body)
    refused(p, fragment)


def test_a_file_that_is_no_model_is_refused_quoting_none_of_its_bytes(tmp_path: Path) -> None:
    """A ``.env`` where a model was expected: "not a safetensors header",
    its size, and not one run of its bytes (its first 8 used to be quoted
    as "a header of N bytes": ``HF_TOKEN``)."""
    body = b"HF_TOKEN=hf_SeCrEtToKeNvAlUe1234567890\n"
    (p := tmp_path / "notes.safetensors").write_bytes(body)
    msg = refused(p, "not a safetensors header", f"{len(body)} bytes").message
    msg = msg.replace(str(p), "")
    head = [str(int.from_bytes(body[:8], order)) for order in ("little", "big")]
    text = body.decode()
    assert not [h for h in head if h in msg], msg
    assert not [text[i:i + 4] for i in range(len(text) - 3) if text[i:i + 4] in msg], msg
    # A binary header that passes the length check but is not UTF-8: no byte either.
    (p := tmp_path / "bin.safetensors").write_bytes(st_file(b'{"\xfe\xfd": 1}'))
    msg = refused(p, "not UTF-8").message
    assert "xfe" not in msg and "0xfe" not in msg, msg


@pytest.mark.timeout(60)
def test_safetensors_cut_short_anywhere_is_refused(tmp_path: Path) -> None:
    good = write_safetensors(tmp_path / "good.safetensors",
                             {f"t{i}": np.arange(7, dtype=np.float32) for i in range(6)})
    whole = good.read_bytes()
    assert open_model(good).nbytes == 6 * 28
    cut = tmp_path / "cut.safetensors"
    for n in range(0, len(whole)):
        cut.write_bytes(whole[:n])
        refused(cut)


def test_sound_files_still_open(tmp_path: Path) -> None:
    """The checks refuse nothing a real writer makes (both formats, raw dtypes, metadata)."""
    g = open_model(write_gguf(tmp_path / "m.gguf", gguf_tensors(2)))
    assert g.format == "gguf" and len(g.tensors) == len(gguf_tensors(2)) + 1
    arr = g.read([g.tensors[0].name])[g.tensors[0].name]
    assert arr.nbytes == g.tensors[0].nbytes
    s = open_model(write_raw_safetensors(tmp_path / "r.safetensors", {
        "a": ("BF16", [2, 3], bytes(12)), "b": ("F8_E4M3", [5], bytes(5)),
        "c": ("F32", [], bytes(4))}))
    assert [(t.name, t.shape, t.nbytes) for t in s.tensors] == [
        ("a", (2, 3), 12), ("b", (5,), 5), ("c", (), 4)]
    meta = json.dumps({"__metadata__": {"format": "pt"},
                       "z": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})
    (p := tmp_path / "empty-tensor.safetensors").write_bytes(st_file(meta))
    assert open_model(p).tensors[0].shape == (0,)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_cli_load_of_a_malicious_file_exits_2_with_one_line(tmp_path: Path, kind: str) -> None:
    """Before any connection: nothing listens on the endpoint given."""
    if kind == "gguf":
        body = gguf_file(gstr(b"a") + struct.pack("<IIQ", ARRAY, U8, 1 << 40), n_kv=1)
    else:
        body = st_file('{"t": {"dtype": "F32", "shape": ' + "[" * 100_000 + "]" * 100_000 + "}}")
    (p := tmp_path / f"evil.{kind}").write_bytes(body)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "rpcbuf.cli", "load", str(p), "--endpoint",
                          "127.0.0.1:9", "--token", "x"], capture_output=True, text=True,
                         cwd=ROOT, timeout=30, env={**os.environ})
    took = time.perf_counter() - t0
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(p) in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert took < 5, f"rpcbuf load took {took:.1f} s"  # 0.3 s here, Python's start included
