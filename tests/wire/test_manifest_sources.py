"""Source types and logical shapes in the one manifest model (``wire/manifest.py``)
and on the wire (``wire/protocol.py``): ``store_batch``, ``dedup_store`` and
``load_file`` carry them per kind, the wire bounds them before any check,
``check`` records them per kind, entries hold them only when given, and the
client's ``ManifestTable`` keeps and merges them as the daemon's entry dicts
do."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.manifest import (
    ManifestTable,
    Packed,
    check,
    merge_entries,
    source_columns,
)

OFFSETS, SIZES = [0, 512, 1024], [16, 16, 8]


def _listed(source_types: list[str | None] | None = ["Q8_0", "Q4_0", "F32"],  # noqa: B006
            logical_shapes: list[list[int] | None] | None = [[2, 32], [2, 32], [2]],  # noqa: B006
            ) -> P.StoreBatch:
    """A batch of per-tensor columns, packed as the client packs them."""
    packed = Packed.of_columns(["q", "r", "s"], ["|u1", "|u1", "<f4"], [[2, 8], [2, 8], [2]],
                               source_types, logical_shapes)
    return P.StoreBatch("b", P.pack_u64(OFFSETS), P.pack_u64(SIZES), **packed.fields())


def _packed(**kw: object) -> P.StoreBatch:
    fields: dict[str, object] = dict(
        buffer_id="b", offsets=P.pack_u64(OFFSETS), sizes=P.pack_u64(SIZES),
        names=["q", "r", "s"], kinds=P.pack_u64([0, 1, 2]),
        kind_dtypes=["|u1", "|u1", "<f4"], kind_shapes=[[2, 8], [2, 8], [2]],
        kind_source_types=["Q8_0", "Q4_0", None], kind_logical_shapes=[[2, 32], None, [2]])
    fields.update(kw)
    return P.StoreBatch(**fields)  # type: ignore[arg-type]


def _sizes() -> np.ndarray:
    return np.array(SIZES, dtype=np.uint64)


def _entries(req: P.StoreBatch | P.DedupStore) -> dict[str, dict[str, Any]]:
    cols = check(req, _sizes())
    assert cols is not None
    return cols.entries(np.array(OFFSETS, np.uint64), _sizes(), [1, 2, 3])


# -- the wire ---------------------------------------------------------------------------


def test_every_request_round_trips_through_the_wire() -> None:
    for req in (_listed(), _packed(), _dedup(), _listed(source_types=None),
                _packed(kind_logical_shapes=None)):
        assert P.parse_request(req.to_wire(7)) == (7, req)
    assert P.PROTOCOL_VERSION >= 3  # the version that says a daemon knows the fields


@pytest.mark.parametrize("bad", [
    ["Q8-0", "Q4_0", "F32"], ["Q8 0", "Q4_0", "F32"], ["", "Q4_0", "F32"],
    ["x" * (P.MAX_SOURCE_TYPE + 1), "Q4_0", "F32"], [8, "Q4_0", "F32"],
    ["Q8_0\n", "Q4_0", "F32"], ["Q8_0é", "Q4_0", "F32"], "Q8_0", [["Q8_0"], "Q4_0", "F32"]])
def test_a_bad_source_type_is_refused_by_the_wire(bad: object) -> None:
    with pytest.raises(P.RequestError) as info:
        P.parse_request({**_packed().to_wire(3), "kind_source_types": bad})
    assert info.value.req_id == 3 and info.value.error.code == "BAD_REQUEST"
    assert "source type" in info.value.error.message or "a list" in info.value.error.message
    assert "é" not in info.value.error.message and "\n" not in info.value.error.message


@pytest.mark.parametrize("bad", [
    [[1] * (P.MAX_NDIM + 1), None, None], [[1 << 40, 1 << 40], None, None], [[-1], None, None],
    [[2.0], None, None], [[True], None, None], [3, None, None], [(2, 32), None, None]])
def test_a_bad_logical_shape_is_refused_by_the_wire(bad: object) -> None:
    with pytest.raises(P.RequestError) as info:
        P.parse_request({**_packed().to_wire(4), "kind_logical_shapes": bad})
    assert info.value.error.code == "BAD_REQUEST" and "shapes" in info.value.error.message


def test_the_largest_accepted_source_type_and_logical_shape() -> None:
    name = "A_z9" * (P.MAX_SOURCE_TYPE // 4)
    req = _packed(kind_source_types=[name, None, None],
                  kind_logical_shapes=[[1] * P.MAX_NDIM, None, [(1 << 63) - 1]])
    assert P.parse_request(req.to_wire(1))[1] == req
    assert _entries(req)["q"]["source_type"] == name


# -- check and entries ------------------------------------------------------------------


def test_entries_hold_what_was_given_and_nothing_else() -> None:
    got = _entries(_listed())
    assert got["q"] == {"dtype": "|u1", "shape": (2, 8), "offset": 0, "nbytes": 16,
                        "checksum": 1, "source_type": "Q8_0", "logical_shape": (2, 32)}
    assert got["s"]["source_type"] == "F32" and got["s"]["logical_shape"] == (2,)
    packed = _entries(_packed())
    assert packed["q"]["source_type"] == "Q8_0" and packed["q"]["logical_shape"] == (2, 32)
    assert packed["r"]["source_type"] == "Q4_0" and "logical_shape" not in packed["r"]
    assert "source_type" not in packed["s"] and packed["s"]["logical_shape"] == (2,)
    plain = _entries(_listed(source_types=None, logical_shapes=None))
    assert all(set(e) == {"dtype", "shape", "offset", "nbytes", "checksum"}
               for e in plain.values())
    nulls = _entries(_listed(source_types=[None] * 3, logical_shapes=[None] * 3))
    assert nulls == plain


def test_kinds_differ_by_source_type_and_logical_shape() -> None:
    # q and r share dtype and shape: one kind without sources, two with
    plain = check(_listed(source_types=None, logical_shapes=None), _sizes())
    described = check(_listed(), _sizes())
    assert plain is not None and described is not None
    assert len(plain.dtypes) == 2 and len(described.dtypes) == 3
    assert described.sources == ["Q8_0", "Q4_0", "F32"]
    same = check(_listed(source_types=["Q8_0", "Q8_0", "F32"]), _sizes())
    assert same is not None and len(same.dtypes) == 2


@pytest.mark.parametrize(("req", "words"), [
    (_packed(kind_source_types=["Q8_0"]), "1 kind_source_types for 3 kinds"),
    (_packed(kind_logical_shapes=[None] * 4), "4 kind_logical_shapes for 3 kinds"),
    (_packed(names=None, kinds=None, kind_dtypes=None, kind_shapes=None), "need a manifest"),
])
def test_check_refuses_what_does_not_add_up(req: P.StoreBatch, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        check(req, _sizes())
    assert words in info.value.message


def test_dedup_store_records_them() -> None:
    got = _entries(_dedup(kind_logical_shapes=None))
    assert got["q"]["source_type"] == "Q8_0" and "source_type" not in got["r"]
    assert not any("logical_shape" in e for e in got.values())
    with pytest.raises(BadRequest, match="1 kind_source_types for 3 kinds"):
        check(_dedup(kind_source_types=["Q8_0"]), _sizes())


def _dedup(**kw: object) -> P.DedupStore:
    fields: dict[str, object] = dict(
        buffer_id="b", offsets=P.pack_u64(OFFSETS), sizes=P.pack_u64(SIZES),
        hashes=P.pack_u64([0] * 6), checksums=P.pack_u64([0] * 3), names=["q", "r", "s"],
        kinds=P.pack_u64([0, 1, 2]), kind_dtypes=["|u1", "|u1", "<f4"],
        kind_shapes=[[2, 8], [2, 8], [2]], kind_source_types=["Q8_0", None, "F32"],
        kind_logical_shapes=[[2, 32], None, None])
    fields.update(kw)
    return P.DedupStore(**fields)  # type: ignore[arg-type]


# -- what the client builds --------------------------------------------------------------


def test_source_columns() -> None:
    assert source_columns(["a", "b"], None) == (None, None)
    assert source_columns(["a", "b"], {"c": ("F32", (1,))}) == (None, None)
    assert source_columns(["a", "b"], {"b": ("Q8_0", (2, np.int64(32)))}) == (
        [None, "Q8_0"], [None, [2, 32]])
    assert source_columns(["a"], {"a": ("BF16", None)}) == (["BF16"], None)
    for bad in ({"a": "Q8_0"}, {"a": ("Q8_0", 5)}, {"a": ("Q8_0", [1.5])}):
        with pytest.raises(BadRequest, match="pairs"):
            source_columns(["a"], bad)  # type: ignore[arg-type]


def test_packed_carries_them_per_kind_and_only_when_described() -> None:
    arrays = [np.zeros((2, 8), np.uint8), np.zeros((2, 8), np.uint8), np.zeros(2, np.float32)]
    names = ["q", "r", "s"]
    plain = Packed.of_arrays(names, arrays)
    assert plain.described(None, None) is plain
    assert plain.described([None] * 3, [None] * 3) is plain
    p = plain.described(["Q8_0", "Q4_0", None], [[2, 32], [2, 32], None])
    assert len(p.dtypes) == 3 and p.sources is not None and p.logicals is not None
    assert np.array_equal(p.item_nbytes(), [16, 16, 8])
    fields = p.fields()
    assert fields["kind_source_types"] == p.sources
    assert fields["kind_logical_shapes"] == [None if s is None else list(s) for s in p.logicals]
    assert "kind_source_types" not in plain.fields()
    taken = p.take(np.array([2, 0, 1]))
    assert taken.names == ["s", "q", "r"] and taken.sources == p.sources
    with pytest.raises(BadRequest, match="2 source types for 3 tensors"):
        plain.described(["Q8_0", "F32"], None)
    with pytest.raises(BadRequest, match="bad logical shapes"):
        plain.described(None, [[1.5], None, None])
    cols = Packed.of_columns(names, ["|u1", "|u1", "<f4"], [[2, 8], [2, 8], [2]],
                             ["Q8_0", "Q8_0", None], None)
    assert len(cols.dtypes) == 2 and cols.sources == ["Q8_0", None] and cols.logicals is None


SOURCES = st.one_of(st.none(), st.sampled_from(["Q8_0", "Q4_K", "BF16", "F32"]))
LOGICAL = st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=4))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(2,), (3, 2), ()]), SOURCES, LOGICAL), max_size=12))
def test_client_and_daemon_agree_on_described_entries(
        specs: list[tuple[tuple[int, ...], str | None, list[int] | None]]) -> None:
    """What the client caches (``ManifestTable.of_batch``) is what the daemon
    records from the same request (``check`` + ``entries``), through the wire,
    and what ``of_entries`` reads back from the daemon's answer."""
    names = [f"t{i}" for i in range(len(specs))]
    arrays = [np.zeros(shape, np.float32) for shape, _, _ in specs]
    sizes = np.array([a.nbytes for a in arrays], dtype=np.uint64)
    offsets = (np.arange(len(specs), dtype=np.uint64) * 256)
    packed = Packed.of_arrays(names, arrays).described([s for _, s, _ in specs],
                                                       [g for _, _, g in specs])
    req = P.parse_request(P.StoreBatch("b", P.pack_u64(offsets), P.pack_u64(sizes),
                                       **packed.fields()).to_wire(1))[1]
    cols = check(req, sizes)  # type: ignore[arg-type]
    if not specs:
        return
    assert cols is not None
    daemon = cols.entries(offsets, sizes, list(range(len(specs))))
    client = ManifestTable.of_batch(packed, offsets.astype(np.int64), sizes.astype(np.int64),
                                    np.arange(len(specs), dtype=np.uint64))
    back = ManifestTable.of_entries(daemon)
    for n, (shape, src, logical) in zip(names, specs, strict=True):
        for e in (client[n], back[n]):
            assert e.get("source_type") == src
            assert e.get("logical_shape") == logical
            assert e["shape"] == list(shape) and e["checksum"] == daemon[n]["checksum"]
        assert daemon[n].get("source_type") == src
        assert (None if "logical_shape" not in daemon[n] else list(daemon[n]["logical_shape"])
                ) == logical


def test_the_client_cache_merges_them_as_the_daemon_does() -> None:
    before = {"a": {"dtype": "<f4", "shape": [4], "offset": 0, "nbytes": 16, "checksum": 1},
              "b": {"dtype": "|u1", "shape": [2, 8], "offset": 256, "nbytes": 16,
                    "checksum": 2, "source_type": "Q8_0", "logical_shape": [2, 32]}}
    table = ManifestTable.of_entries(before)
    assert dict(table) == before
    packed = Packed.of_columns(["c", "a"], ["|u1", "<f4"], [[2, 8], [4]], ["Q4_0", "F32"],
                               [[2, 32], None])
    written = ManifestTable.of_batch(packed, np.array([512, 0]), np.array([16, 16]),
                                     np.array([3, 4], np.uint64))
    merged = table.merged(written, ["b"])
    daemon = {k: dict(v) for k, v in before.items()}
    merge_entries(daemon, {n: written[n] for n in written}, ["b"])
    assert dict(merged) == daemon
    assert merged["a"] == {"dtype": "<f4", "shape": [4], "offset": 0, "nbytes": 16,
                           "checksum": 4, "source_type": "F32"}
    assert merged["c"]["logical_shape"] == [2, 32]
    # a plain store over a described table, and the other way round
    plain = ManifestTable.of_batch(Packed.of_columns(["d"], ["<f4"], [[4]]), np.array([768]),
                                   np.array([16]), np.array([5], np.uint64))
    assert "source_type" not in table.merged(plain)["d"]
    assert plain.merged(written)["c"]["source_type"] == "Q4_0"
    assert dict(table) == before  # never changed in place


# -- load_file ---------------------------------------------------------------------------


def _load_file(**kw: object) -> P.LoadFile:
    fields: dict[str, object] = dict(
        buffer_id="b", path="m.gguf", file_size=1 << 20, file_offsets=P.pack_u64([0, 64, 128]),
        offsets=P.pack_u64(OFFSETS), sizes=P.pack_u64(SIZES), hashes=P.pack_u64([0] * 6),
        checksums=P.pack_u64([0] * 3), names=["q", "r", "s"], kinds=P.pack_u64([0, 1, 2]),
        kind_dtypes=["|u1", "|u1", "<f4"], kind_shapes=[[2, 8], [2, 8], [2]],
        kind_source_types=["Q8_0", "Q4_0", None], kind_logical_shapes=[[2, 32], None, [2]])
    fields.update(kw)
    return P.LoadFile(**fields)  # type: ignore[arg-type]


def test_load_file_records_them() -> None:
    req = _load_file()
    assert P.parse_request(req.to_wire(3)) == (3, req)
    got = _entries(req)  # type: ignore[arg-type]
    assert (got["q"]["source_type"], got["q"]["logical_shape"]) == ("Q8_0", (2, 32))
    assert "logical_shape" not in got["r"] and "source_type" not in got["s"]
    with pytest.raises(BadRequest, match="3 kind_source_types for"):
        check(_load_file(kind_source_types=["Q8_0"] * 3, kinds=None, kind_dtypes=["|u1"],
                         kind_shapes=[[16]]), _sizes())


@pytest.mark.parametrize(("field", "bad"), [
    ("kind_source_types", ["Q8-0", None, None]), ("kind_source_types", ["x" * 33, None, None]),
    ("kind_logical_shapes", [[-1], None, None]), ("kind_logical_shapes", [[1 << 62, 4]]),
    ("source_types", ["Q8_0"] * 3), ("dtypes", ["|u1"] * 3),  # no list form
])
def test_load_file_source_fields_are_bounded_by_the_wire(field: str, bad: object) -> None:
    wire = _load_file().to_wire(1)
    with pytest.raises(P.RequestError, match=field):
        P.parse_request({**wire, field: bad})
