"""The error registry (``rpcbuf.control.wire.errors``): one class per wire code,
refinements inherit their parent's, client-only errors never come off the wire."""

from __future__ import annotations

import pytest

from rpcbuf.control.client.cluster import ClusterError
from rpcbuf.control.wire import errors as E
from rpcbuf.control.wire.protocol import FrameError


def test_every_wire_code_maps_to_its_class() -> None:
    for code in E.ALL_CODES:
        assert E.error_from_wire({"code": code, "message": "m"}).code == code
    assert type(E.error_from_wire({"code": "NOT_FOUND", "message": "x"})) is E.NotFound


def test_a_second_class_for_a_code_is_refused() -> None:
    with pytest.raises(TypeError, match="NOT_FOUND"):
        type("Shadow", (E.RpcBufError,), {"code": "NOT_FOUND"})


def test_refinements_and_client_only_errors_are_not_built_from_the_wire() -> None:
    assert FrameError("x").code == "BAD_REQUEST"
    assert type(E.error_from_wire({"code": "BAD_REQUEST"})) is E.BadRequest
    got = E.error_from_wire({"code": ClusterError.code, "message": "forged"})
    assert type(got) is E.RpcBufError and got.details["code"] == "CLUSTER_ERROR"
    assert ClusterError.code not in E.ALL_CODES


def test_malformed_errors_become_the_root_class() -> None:
    for bad in (None, "x", {"code": 5}, {"code": "NOPE", "details": [1]}):
        assert type(E.error_from_wire(bad)) is E.RpcBufError
