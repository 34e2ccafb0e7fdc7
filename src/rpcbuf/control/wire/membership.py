"""A node's record in the fleet registry (etcd), sans-I/O: the registry address,
the key layout and the record, defined once for daemon and client.

One key per node, ``/rpcbuf/v1/<cluster>/nodes/<node_id>``, on the daemon's
lease; the value is a small JSON ``NodeRecord`` (node id, control address, UCX
port, versions, each device's total/free/largest free, start and write times).
Nothing about tenants.  Whoever can write the prefix can advertise a node, so a
record is a hint, not a credential: ``parse_record`` bounds every field
(``MAX_RECORD`` bytes, ``MAX_DEVICES``, short printable strings, numbers in
[0, 2**63)), and the client still authenticates and checks the node id.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEME = "etcd://"
KEY_ROOT = "/rpcbuf/v1/"
MAX_RECORD = 16 << 10  # bytes of one record's JSON
MAX_DEVICES = 64
MAX_TEXT = 256
MAX_INT = (1 << 63) - 1
MAX_ENDPOINTS = 16  # etcd members in one registry address
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")  # cluster names
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}")  # also a default "host:port"
DEFAULT_CLUSTER = "default"
DEFAULT_TTL = 5  # s: the lease of a node's key (a crashed node goes this long after)


class RecordError(ValueError):
    """A registry record (or address) that cannot be used; says which field."""


@dataclass(frozen=True)
class RegistryAddress:
    """``etcd://h1:2379,h2:2379``: the etcd members to ask, in order."""

    endpoints: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return SCHEME + ",".join(f"{host_port(h, p)}" for h, p in self.endpoints)


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_registry(text: str | None) -> bool:
    return bool(text) and str(text).strip().startswith(SCHEME)


def parse_registry(text: str) -> RegistryAddress:
    """``etcd://HOST:PORT[,HOST:PORT...]``. Raises ``RecordError``."""
    text = text.strip()
    if not text.startswith(SCHEME):
        raise RecordError(f"registry {text!r}: want etcd://HOST:PORT[,HOST:PORT...]")
    out: list[tuple[str, int]] = []
    for part in text[len(SCHEME):].rstrip("/").split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RecordError(f"registry {text!r}: {part.strip()!r} is not HOST:PORT")
        out.append((host, int(port)))
    if len(out) > MAX_ENDPOINTS:
        raise RecordError(f"registry {text!r}: more than {MAX_ENDPOINTS} etcd members")
    return RegistryAddress(tuple(out))


def check_name(what: str, name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise RecordError(f"{what} {name!r}: letters, digits and _.@- only (at most 128, "
                          "starting with a letter or digit)")
    return name


def check_node_id(what: str, node_id: str) -> str:
    if not NODE_ID_RE.fullmatch(node_id):
        raise RecordError(f"{what} {node_id!r}: letters, digits and _.@:- only (at most 128, "
                          "starting with a letter or digit)")
    return node_id


def prefix(cluster: str) -> str:
    return f"{KEY_ROOT}{check_name('cluster', cluster)}/nodes/"


def node_key(cluster: str, node_id: str) -> str:
    return prefix(cluster) + check_node_id("node id", node_id)


@dataclass(frozen=True)
class DeviceFigures:
    key: str  # "cpu:0", "cuda:1"
    total: int
    free: int
    largest_free: int


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    address: str  # advertised control HOST:PORT
    ucx_port: int
    version: str  # rpcbuf's
    protocol: tuple[int, int]  # [oldest, newest] protocol version it speaks
    started_at: float
    updated_at: float
    devices: tuple[DeviceFigures, ...] = field(default=())

    @property
    def free(self) -> int:
        return sum(d.free for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["protocol"] = list(self.protocol)
        out["devices"] = [asdict(d) for d in self.devices]
        return out

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True).encode()

    def same_figures(self, other: NodeRecord | None) -> bool:
        """Equal but for ``updated_at``."""
        return other is not None and self.to_json() | {"updated_at": 0} == \
            other.to_json() | {"updated_at": 0}


def _text(obj: dict[str, Any], key: str, limit: int = MAX_TEXT) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not v or len(v) > limit or not v.isprintable():
        raise RecordError(f"record field {key!r}: want printable text of at most {limit}")
    return v


def _int(obj: dict[str, Any], key: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
        raise RecordError(f"record field {key!r}: want a whole number in [0, 2**63)")
    return v


def _time(obj: dict[str, Any], key: str) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e11:
        raise RecordError(f"record field {key!r}: want a Unix time")
    return float(v)


def parse_record(raw: bytes, key: str | None = None) -> NodeRecord:
    """Raises ``RecordError``.  ``key``'s last part must be the record's node
    id (a record cannot speak for another key)."""
    if len(raw) > MAX_RECORD:
        raise RecordError(f"record of {len(raw)} bytes (at most {MAX_RECORD})")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RecordError("record is not JSON") from None
    if not isinstance(obj, dict):
        raise RecordError("record is not a JSON object")
    node_id = check_node_id("record node id", _text(obj, "node_id"))
    if key is not None and key.rpartition("/")[2] != node_id:
        raise RecordError(f"record for {node_id!r} under the key {key!r}")
    address = _text(obj, "address")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RecordError(f"record field 'address': {address!r} is not HOST:PORT")
    ucx_port = _int(obj, "ucx_port")
    if ucx_port > 65535:
        raise RecordError("record field 'ucx_port': not a port")
    proto = obj.get("protocol")
    if not isinstance(proto, list) or len(proto) != 2 or \
            not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 16
                    for v in proto) or proto[0] > proto[1]:
        raise RecordError("record field 'protocol': want [oldest, newest]")
    devs = obj.get("devices")
    if not isinstance(devs, list) or len(devs) > MAX_DEVICES:
        raise RecordError(f"record field 'devices': want a list of at most {MAX_DEVICES}")
    devices = []
    for d in devs:
        if not isinstance(d, dict):
            raise RecordError("record field 'devices': want objects")
        fig = DeviceFigures(_text(d, "key", 32), _int(d, "total"), _int(d, "free"),
                            _int(d, "largest_free"))
        if not fig.largest_free <= fig.free <= fig.total:
            raise RecordError(f"record device {fig.key}: want largest_free <= free <= total")
        devices.append(fig)
    return NodeRecord(node_id, address, ucx_port, _text(obj, "version", 64),
                      (proto[0], proto[1]), _time(obj, "started_at"),
                      _time(obj, "updated_at"), tuple(devices))
