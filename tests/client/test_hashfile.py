"""Hash manifests (``models/hashfile.py``): written by ``rpcbuf hash``,
read bounded and checked, and refused when stale or malformed."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from models import gguf_tensors, llama_tensors, write_gguf, write_safetensors
from rpcbuf.control.client.dedup import content_hashes
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.models import hashfile, metadata as MD
from rpcbuf.models.hashfile import (
    MAX_BYTES,
    describe,
    hash_model,
    manifest_path,
    read_manifest,
    write_manifest,
)
from rpcbuf.models.modelfile import open_model


def written(path: Path) -> Path:
    model = open_model(path)
    try:
        write_manifest(hash_model(model, use_cache=False), manifest_path(path))
    finally:
        model.close()
    return manifest_path(path)


@pytest.mark.parametrize("kind", ["st", "gguf", "shards"])
def test_a_manifest_says_what_the_model_holds(tmp_path: Path, kind: str) -> None:
    if kind == "st":
        path = write_safetensors(tmp_path / "m.safetensors", llama_tensors(2))
    elif kind == "gguf":
        path = write_gguf(tmp_path / "m.gguf", gguf_tensors(2))
    else:
        path = tmp_path / "shards"
        path.mkdir()
        t = llama_tensors(2)
        names = list(t)
        write_safetensors(path / "a.safetensors", {n: t[n] for n in names[:5]})
        write_safetensors(path / "b.safetensors", {n: t[n] for n in names[5:]})
    out = written(path)
    assert out.name == ("rpcbuf-hashes.json" if kind == "shards" else
                        path.name + ".rpcbuf-hashes.json")
    hm = read_manifest(out)
    model = open_model(path)
    try:
        arrays = model.read([t.name for t in model.tensors])
        want = content_hashes(arrays)
        got = {t.name: (t.digest, t.checksum) for _, t in hm.tensors}
        assert got == want
        for k, t in hm.tensors:
            assert (k, t.file_offset) == model.where(t.name)
            assert t.dtype == model.by_name[t.name].dtype
            assert t.source == model.by_name[t.name].source  # type, logical shape
        assert hm.metadata == model.metadata and hm.metadata  # what an upload stores
        assert np.array_equal(hm.blob(), MD.encode(model.format, model.metadata))
        assert [f.size for f in hm.files] == [os.stat(f).st_size for f in model.files]
    finally:
        model.close()
    hm2 = describe(path)  # the model with its manifest beside it: nothing hashed
    assert hm2.hashed == 0 and hm2.source == "manifest"


def test_without_a_manifest_the_local_copy_is_hashed(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", llama_tensors(1))
    hm = describe(path, use_cache=False)
    assert hm.source == "hashed" and hm.hashed == hm.nbytes > 0


def test_a_stale_manifest_is_refused(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", llama_tensors(1))
    written(path)
    t = llama_tensors(1)
    t["extra.weight"] = np.zeros(8, np.float32)
    write_safetensors(path, t)  # the model changed after `rpcbuf hash`
    with pytest.raises(BadRequest, match=r"does not match.*run 'rpcbuf hash"):
        describe(path)


def put(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


GOOD_T = ["w", "<f4", "F32", [2], None, 8, 8, "0" * 32, 5]


@pytest.mark.parametrize(("doc", "match"), [
    ([], "rpcbuf_hashes"),
    ({"rpcbuf_hashes": 1}, "rpcbuf_hashes"),  # version 1 had no metadata
    ({"rpcbuf_hashes": 2, "format": "pickle"}, "format"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": {}}, "files"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": [{"name": "../x", "size": 16,
                                                       "tensors": []}]}, "plain file name"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": [{"name": "m", "size": -1,
                                                       "tensors": []}]}, "size"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": [{"name": "m", "size": 16,
                                                       "tensors": [GOOD_T[:8]]}]}, "is not"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [["w", "O", *GOOD_T[2:]]]}]}, "Python"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:3], [3], *GOOD_T[4:]]]}]},
     "not 8 bytes"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 12, "tensors": [GOOD_T]}]}, "run past"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:7], "z" * 32, 5]]}]},
     "invalid literal"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:8], 1 << 64]]}]}, "xxh3-64"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [GOOD_T, GOOD_T]}]}, "twice"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:4], [True], *GOOD_T[5:]]]}]},
     "logical shape"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:4], [1 << 62, 4],
                                                        *GOOD_T[5:]]]}]}, "2\\*\\*63"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:4], [1] * 33, *GOOD_T[5:]]]}]},
     "logical shape"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:2], "Q4-K", *GOOD_T[3:]]]}]},
     "source dtype"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "metadata": 7, "files": []}, "base64 string"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "metadata": "!!!!", "files": []}, "not base64"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": [],
      "metadata": base64.b64encode(b"\xc1junk").decode()}, "not msgpack"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": [],
      "metadata": base64.b64encode(msgpack.packb({"a": 1})).decode()}, "not rpcbuf's"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": [],
      "metadata": base64.b64encode(msgpack.packb(
          {"rpcbuf_model_metadata": 1, "format": "gguf", "metadata": {"k": {"x": 1}}})).decode()},
     "holds a value of type dict"),
    ({"rpcbuf_hashes": 2, "format": "gguf", "files": [],
      "metadata": base64.b64encode(MD.encode("safetensors", {}).tobytes()).decode()},
     "of a safetensors model"),
    ({"rpcbuf_hashes": 2, "format": "gguf",
      "files": [{"name": "m", "size": 16, "tensors": [[*GOOD_T[:3], [True], *GOOD_T[4:]]]}]},
     "shape"),
])
def test_malformed_manifests_are_refused_by_name(tmp_path: Path, doc: object,
                                                 match: str) -> None:
    path = put(tmp_path / "m.rpcbuf-hashes.json", doc)
    with pytest.raises(BadRequest, match=match) as info:
        read_manifest(path)
    assert str(path) in info.value.message


def test_a_good_hand_written_manifest_reads(tmp_path: Path) -> None:
    hm = read_manifest(put(tmp_path / "m.rpcbuf-hashes.json",
                           {"rpcbuf_hashes": 2, "format": "gguf",
                            "files": [{"name": "m", "size": 16, "tensors": [GOOD_T]}]}))
    assert [t.name for _, t in hm.tensors] == ["w"]
    assert hm.metadata == {} and next(hm.tensors)[1].source == ("F32", (2,))


def test_metadata_is_bounded_before_it_is_decoded(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    blob = base64.b64encode(MD.encode("gguf", {"general.name": "x" * 300}).tobytes()).decode()
    doc = {"rpcbuf_hashes": 2, "format": "gguf", "metadata": blob,
           "files": [{"name": "m", "size": 16, "tensors": [GOOD_T]}]}
    path = put(tmp_path / "m.rpcbuf-hashes.json", doc)
    assert read_manifest(path).metadata == {"general.name": "x" * 300}
    monkeypatch.setattr(hashfile, "MAX_METADATA_CHARS", len(blob) - 1)
    decoded: list[object] = []
    monkeypatch.setattr(MD, "decode", lambda *a: decoded.append(a))
    with pytest.raises(BadRequest, match="at most"):
        read_manifest(path)
    assert decoded == []


def test_a_manifest_that_names_other_source_types_is_stale(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(1))
    out = written(path)
    doc = json.loads(out.read_text())
    quant = next(t for f in doc["files"] for t in f["tensors"] if t[2] == "Q8_0")
    assert quant[4] != quant[3]  # its logical shape is not its rows'
    quant[4] = quant[3]
    out.write_text(json.dumps(doc))
    with pytest.raises(BadRequest, match="not as the manifest says"):
        describe(path)


def test_huge_and_deep_manifests_are_refused_at_once(tmp_path: Path) -> None:
    huge = tmp_path / "huge.rpcbuf-hashes.json"
    with open(huge, "wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing is written, nothing should be read
    t0 = time.monotonic()
    with pytest.raises(BadRequest, match="at most"):
        read_manifest(huge)
    deep = put(tmp_path / "deep.rpcbuf-hashes.json", None)
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BadRequest, match="nests deeper"):
        read_manifest(deep)
    assert time.monotonic() - t0 < 2.0
