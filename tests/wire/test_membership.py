"""The registry record and address (``wire/membership.py``): what a daemon
writes parses back to the same record, and whatever else is in the prefix is
refused with the field named, never trusted."""

from __future__ import annotations

import json

import pytest

from rpcbuf.control.wire.membership import (
    MAX_RECORD,
    DeviceFigures,
    NodeRecord,
    RecordError,
    node_key,
    parse_record,
    parse_registry,
)

REC = NodeRecord("n1", "10.0.0.5:7700", 7701, "0.1.0", (1, 2), 1.7e9, 1.7e9 + 5,
                 (DeviceFigures("cpu:0", 100, 60, 50),))


def test_a_record_round_trips_and_its_key_must_name_it() -> None:
    assert parse_record(REC.encode(), node_key("prod", "n1")) == REC
    with pytest.raises(RecordError, match="under the key"):
        parse_record(REC.encode(), node_key("prod", "n2"))
    assert REC.same_figures(NodeRecord(**{**REC.__dict__, "updated_at": 1.8e9}))


@pytest.mark.parametrize("field, value", [
    ("node_id", "../etc"), ("address", "nohost"), ("ucx_port", 70000), ("ucx_port", -1),
    ("protocol", [2, 1]), ("devices", [{"key": "cpu:0", "total": 1, "free": 2,
                                        "largest_free": 0}]),
    ("devices", [{}] * 65), ("version", "x" * 100), ("started_at", "now"),
])
def test_a_bad_field_is_refused_by_name(field: str, value: object) -> None:
    obj = REC.to_json() | {field: value}
    with pytest.raises(RecordError):
        parse_record(json.dumps(obj).encode())


def test_garbage_and_huge_records_are_refused() -> None:
    for raw in (b"", b"[1]", b"\xff", b"{" * 10, b" " * (MAX_RECORD + 1)):
        with pytest.raises(RecordError):
            parse_record(raw)


def test_registry_addresses() -> None:
    assert parse_registry("etcd://a:2379,b:2380").endpoints == (("a", 2379), ("b", 2380))
    assert str(parse_registry("etcd://[::1]:2379")) == "etcd://[::1]:2379"
    for bad in ("http://a:1", "etcd://a", "etcd://a:0", "etcd://:1", "etcd://a:x"):
        with pytest.raises(RecordError):
            parse_registry(bad)
