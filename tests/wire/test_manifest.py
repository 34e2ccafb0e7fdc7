"""The one manifest model (``control/wire/manifest.py``), with no daemon: the
packed wire form built and checked, the dtype table, bounds, unique names, and the
merge rule that the daemon (entry dicts) and the client (``ManifestTable``)
apply alike."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rpcbuf.control.wire import manifest as WM, protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.manifest import ManifestTable, Packed, check


def _batch(**kw: object) -> P.StoreBatch:
    fields: dict[str, object] = dict(
        buffer_id="b", offsets=P.pack_u64([0, 64, 128]), sizes=P.pack_u64([16, 16, 8]),
        names=["a", "b", "c"], kinds=P.pack_u64([0, 0, 1]), kind_dtypes=["<f4", "int16"],
        kind_shapes=[[2, 2], [4]])
    fields.update(kw)
    return P.StoreBatch(**fields)  # type: ignore[arg-type]


# -- build and check ----------------------------------------------------------------------


def test_packed_manifest_fields_round_trip_and_bad_types() -> None:
    req = _batch()
    assert P.parse_request(req.to_wire(3)) == (3, req)
    one_kind = _batch(kinds=None, kind_dtypes=["<f4"], kind_shapes=[[4]])
    assert P.parse_request(one_kind.to_wire(4)) == (4, one_kind)
    for bad in ({"kinds": [0, 0, 1]}, {"kinds": b"\x00" * 7}, {"kinds": "abc"},
                {"kind_dtypes": "<f4"}, {"kind_dtypes": [4, 5]}, {"kind_dtypes": ["x" * 2000]},
                {"kind_shapes": [4, 4]}, {"kind_shapes": [[-1], [4]]}, {"kind_shapes": [["4"]]},
                {"kind_shapes": [[2.0, 2]]}, {"kind_shapes": [[True]]},
                {"dtypes": ["<f4"] * 3, "shapes": [[4]] * 3}):  # no list form
        with pytest.raises(P.RequestError) as info:
            P.parse_request({**req.to_wire(3), **bad})
        assert info.value.req_id == 3 and info.value.error.code == "BAD_REQUEST"


def _sizes(req: P.StoreBatch) -> np.ndarray:
    return P.unpack_u64(req.sizes)


def test_manifest_check_accepts_packed_manifests() -> None:
    cols = check(_batch(), _sizes(_batch()))
    assert cols is not None and cols.dtypes == ["<f4", "<i2"]
    offsets = P.unpack_u64(_batch().offsets)
    entries = cols.entries(offsets, _sizes(_batch()), [1, 2, 3])
    assert entries["a"] == {"dtype": "<f4", "shape": (2, 2), "offset": 0, "nbytes": 16,
                            "checksum": 1}
    assert entries["c"]["dtype"] == "<i2" and list(entries["c"]["shape"]) == [4]
    assert list(cols.entries(offsets, _sizes(_batch()), [9], 1, 2)) == ["b"]
    one = _batch(kinds=None, kind_dtypes=["<f4"], kind_shapes=[[4]],
                 sizes=P.pack_u64([16, 16, 16]))
    assert check(one, _sizes(one)) is not None
    nothing = _batch(names=None, kinds=None, kind_dtypes=None, kind_shapes=None)
    assert check(nothing, _sizes(nothing)) is None


@pytest.mark.parametrize(("change", "words"), [
    ({"names": ["a", "b"]}, "names and kinds must each list all 3"),
    ({"kinds": P.pack_u64([0, 0])}, "names and kinds must each list all 3"),
    ({"kinds": P.pack_u64([0, 0, 2])}, "'c': kind 2 is not in the table of 2 kinds"),
    ({"kind_shapes": [[2, 2]]}, "2 kind_dtypes for 1 kind_shapes"),
    ({"kinds": None}, "of 2 kinds needs kinds"),
    ({"names": None}, "needs names"),
    ({"kind_dtypes": None}, "needs names, kind_dtypes and kind_shapes"),
    ({"kind_dtypes": ["<f4", "nonsense"]}, "unknown dtype 'nonsense'"),
    ({"kind_dtypes": ["<f4", "O"]}, "holds Python objects"),
    ({"kind_dtypes": ["<f4", "i4,O"]}, "holds Python objects"),
    ({"kind_shapes": [[2, 2], [3]]}, "tensor 'c': shape [3] of int16 is not 8 bytes"),
    ({"kind_shapes": [[2, 2], [1 << 62, 1 << 62]]}, "is not 8 bytes"),
    ({"names": ["a", "b", "a"]}, "must be unique"),
])
def test_manifest_check_refuses_bad_manifests(change: dict[str, object], words: str) -> None:
    req = _batch(**change)
    with pytest.raises(BadRequest) as info:
        check(req, _sizes(req))
    assert words in info.value.message


def test_manifest_table_is_a_mapping_of_entries() -> None:
    entries = {"a": {"dtype": "<f4", "shape": [2, 2], "offset": 0, "nbytes": 16, "checksum": 5},
               "b": {"dtype": "<f4", "shape": [4], "offset": 256, "nbytes": 16,
                     "checksum": None},
               "c": {"dtype": "<f4", "shape": [2, 2], "offset": 512, "nbytes": 16,
                     "checksum": 7}}
    t = ManifestTable.of_entries(entries)
    assert dict(t) == entries and len(t) == 3 and "b" in t and "z" not in t
    assert t.get("z") is None and t.end == 768
    assert t.rows(["c", "z", "a"]).tolist() == [2, -1, 0]
    packed = Packed(["b", "d"], np.array([0, 0]), ["<i8"], [(2,)])
    written = ManifestTable.of_batch(packed, np.array([256, 1024]), np.array([16, 16]),
                                     np.array([1, 2], np.uint64))
    merged = t.merged(written, ["c"])
    assert list(merged) == ["a", "b", "d"]
    assert merged["b"] == {"dtype": "<i8", "shape": [2], "offset": 256, "nbytes": 16,
                           "checksum": 1}
    assert merged["a"] == entries["a"] and merged.end == 1280
    assert dict(t) == entries  # never changed in place


def test_packed_of_arrays_kinds() -> None:
    arrays = [np.zeros(3, np.float32), np.zeros(5, np.float32), np.zeros(3, np.float32),
              np.zeros(3, ">f4"), np.zeros(2, np.dtype([("a", "<i2")])),
              np.zeros(2, np.dtype([("a", "<i2")]))]
    for some in (arrays, arrays[:3], [*arrays, np.zeros((2, 3), np.int8), np.zeros((), "<u8")]):
        packed = Packed.of_arrays([f"t{i}" for i in range(len(some))], some)
        for i, a in enumerate(some):
            k = int(packed.kinds[i])
            assert packed.dtypes[k] == a.dtype.str and packed.shapes[k] == a.shape
            assert int(packed.kind_nbytes[k]) == a.nbytes  # type: ignore[index]
        assert np.array_equal(packed.item_nbytes(), [a.nbytes for a in some])
    one = Packed.of_arrays(["a", "b"], [np.zeros((2, 2)), np.ones((2, 2))])
    assert one.fields()["kinds"] is None and one.shapes == [(2, 2)]


DTYPES = ["<f4", "<f2", "<i8", "|u1", "|b1", ">i4", "<c8"]
SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
ARRAYS = st.lists(st.tuples(st.sampled_from(DTYPES), SHAPES), min_size=0, max_size=20)


@settings(max_examples=60, deadline=None)
@given(ARRAYS, st.booleans())
def test_what_the_client_builds_the_daemon_checks_back(specs: list[tuple[str, tuple[int, ...]]],
                                                        as_columns: bool) -> None:
    arrays = [np.zeros(shape, dt) for dt, shape in specs]
    names = [f"t{i}" for i in range(len(arrays))]
    sizes = np.array([a.nbytes for a in arrays], dtype=np.uint64)
    offsets = np.cumsum(np.concatenate(([0], sizes[:-1]))).astype(np.uint64) \
        if len(sizes) else sizes
    if as_columns:  # as store_batch's (names, dtypes, shapes) and load_model build it
        packed = Packed.of_columns(*WM.manifest_columns(dict(zip(names, arrays, strict=True)),
                                                        names))
    else:
        packed = Packed.of_arrays(names, arrays)
        assert np.array_equal(packed.item_nbytes(), sizes)
    req = P.StoreBatch("b", P.pack_u64(offsets), P.pack_u64(sizes), **packed.fields())
    req = P.parse_request(req.to_wire(1))[1]  # through the wire's own validation
    got = check(req, sizes)  # type: ignore[arg-type]
    if not arrays:
        assert got is None or len(got) == 0
        return
    assert got is not None
    entries = got.entries(offsets, sizes, [None] * len(arrays))
    assert list(entries) == names
    for a, e, off in zip(arrays, entries.values(), offsets.tolist(), strict=True):
        assert e["dtype"] == a.dtype.str and tuple(e["shape"]) == a.shape
        assert e["offset"] == off and e["nbytes"] == a.nbytes


def test_of_columns_refuses_unequal_or_bad_columns() -> None:
    with pytest.raises(BadRequest, match="equally long"):
        Packed.of_columns(["a", "b"], ["<f4"], [[1], [2]])
    with pytest.raises(BadRequest, match="bad manifest columns"):
        Packed.of_columns(["a"], ["<f4"], [[1.5]])
    p = Packed.of_columns(["a", "b"], ["<f4", "<f4"], [[2], (2,)])  # a list and a tuple
    assert p.dtypes == ["<f4"] and p.shapes == [(2,)] and p.kinds.tolist() == [0, 0]
    assert Packed.of_columns(["a"], [np.dtype(np.float32)], [[2]]).dtypes == ["<f4"]


def test_shapes_are_bounded_by_the_wire_before_any_check() -> None:
    wire = _batch(kinds=None, kind_dtypes=["|u1"], kind_shapes=[[1]]).to_wire(1)
    for shape in ([1] * (P.MAX_NDIM + 1), [1 << 40, 1 << 40], [-1]):
        with pytest.raises(P.RequestError) as info:
            P.parse_request({**wire, "kind_shapes": [shape]})
        assert info.value.error.code == "BAD_REQUEST"
    # a shape the wire allows but whose bytes pass 2**63 matches no item
    req = _batch(kinds=None, kind_dtypes=["<c16"], kind_shapes=[[1 << 31, 1 << 31]])
    with pytest.raises(BadRequest, match="is not 16 bytes"):
        check(req, np.array([16, 16, 16], dtype=np.uint64))


def test_the_one_dtype_table() -> None:
    assert WM.dtype_of("float32") == ("<f4", 4) and WM.dtype_of("<f4") == ("<f4", 4)
    assert WM.np_dtype("int16") is WM.np_dtype("int16")  # cached
    for bad, words in (("nonsense", "unknown dtype"), ("O", "Python objects"),
                       ("i4,O", "Python objects")):
        with pytest.raises(BadRequest, match=words):
            WM.np_dtype(bad)
    for i in range(WM._DTYPE_CACHE_MAX + 10):  # the peer's names: the cache stays bounded
        WM.np_dtype(f"({i % 50 + 1},)<f4" if i % 2 else f"S{i + 1}")
    assert len(WM._DTYPES) <= WM._DTYPE_CACHE_MAX


# -- the merge rule -----------------------------------------------------------------------


def _entry(off: int, n: int, dtype: str = "|u1", checksum: int | None = None) -> dict[str, object]:
    return {"dtype": dtype, "shape": [n], "offset": off, "nbytes": n, "checksum": checksum}


def test_merge_plan_drops_overwritten_entries_and_counts() -> None:
    old = {"a": _entry(0, 16), "b": _entry(16, 16), "c": _entry(64, 16), "d": _entry(256, 8)}
    # "x" over b's bytes, "a" renewed in place, "y" just past c
    written = [(0, 16), (20, 24), (80, 96)]
    dropped, count = WM.merge_plan(old, ["a", "x", "y"], written, (0, 96))
    assert dropped == ["b"] and count == 5  # a, c, d kept; x, y new; b gone
    assert WM.merge_plan({}, ["a"], [(0, 4)], (0, 4)) == ([], 1)
    assert WM.merge_plan(old, ["a"], [(0, 16)], (0, 16)) == ([], 4)
    WM.check_count(P.MAX_ITEMS)
    with pytest.raises(BadRequest, match="at most") as info:
        WM.check_count(P.MAX_ITEMS + 1)
    assert info.value.details == {"limit": P.MAX_ITEMS}


SLOTS = st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 15), st.integers(1, 4)),
                 max_size=8)


@settings(max_examples=150, deadline=None)
@given(SLOTS, SLOTS)
def test_client_and_daemon_merge_alike(before: list[tuple[str, int, int]],
                                       batch: list[tuple[str, int, int]]) -> None:
    """Entry dicts merged the daemon's way equal the client's ManifestTable.merged."""
    old = {n: _entry(s * 16, k * 4, "<f4" if k % 2 else "|u1", s) for n, s, k in before}
    new = {n: _entry(s * 16, k * 4, "<i2", s + 100) for n, s, k in batch}
    if not new:
        return
    written = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in new.values())  # type: ignore[operator]
    hull = (written[0][0], max(b for _, b in written))
    dropped, count = WM.merge_plan(old, new.keys(), written, hull)
    daemon = {k: dict(v) for k, v in old.items()}
    WM.merge_entries(daemon, new, dropped)
    assert len(daemon) == count
    client = ManifestTable.of_entries(old).merged(ManifestTable.of_entries(new), dropped)
    assert list(client) == list(daemon)
    assert {k: dict(v) for k, v in client.items()} == daemon
