"""``fileload.request``: a batch of a file's tensors as one ``load_file``,
sorted by buffer offset, with their source types and logical shapes only
when the session's protocol records them."""

from __future__ import annotations

import pytest

from rpcbuf.control.client.fileload import FileTensor, request
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest

Q = FileTensor("q", "|u1", (2, 34), 64, 68, 512, 1 << 100, 7, "Q8_0", (2, 32))
F = FileTensor("f", "<f4", (4,), 0, 16, 0, 3, 9, "F32", (4,))


def test_a_request_carries_source_types_and_logical_shapes_per_kind() -> None:
    req = request("b", "m.gguf", 1024, [Q, F])
    assert req.names == ["f", "q"] and P.unpack_u64(req.offsets).tolist() == [0, 512]
    assert req.kind_dtypes is not None and req.kind_source_types is not None
    by_kind = dict(zip(req.kind_dtypes, zip(req.kind_source_types, req.kind_logical_shapes
                                            or [], strict=True), strict=True))
    assert by_kind == {"|u1": ("Q8_0", [2, 32]), "<f4": ("F32", [4])}
    assert P.parse_request(req.to_wire(5)) == (5, req)


def test_unknown_ones_are_left_out() -> None:
    bare = request("b", "m.gguf", 1024, [FileTensor("f", "<f4", (4,), 0, 16, 0, 3, 9)])
    assert bare.kind_source_types is None and bare.kind_logical_shapes is None


def test_too_many_tensors_are_refused_before_packing() -> None:
    with pytest.raises(BadRequest, match="at most"):
        request("b", "m", 1, [F] * (P.MAX_ITEMS // 2 + 1))
