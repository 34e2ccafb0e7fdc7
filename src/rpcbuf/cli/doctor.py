"""``rpcbuf doctor``: per node, in order, each check ``ok``, ``warn`` or ``fail``
with one sentence (reachable, TLS, token, protocol, data path, UCX, round
trips, free memory, clock skew).  A check that cannot run because an earlier
one failed is skipped.  Exit 0 when none failed, else 1.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rpcbuf.cli.errors import ago, sentence
from rpcbuf.control.client.opening import (
    insecure_default,
    is_loopback,
    parse_addr,
    same_host_default,
    tls_context,
)
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import RpcBufError, UcxUnusable
from rpcbuf.control.wire.units import format_size
from rpcbuf.dataplane import ucx
from rpcbuf.dataplane.ucx import rdma_devices

BIG = 64 << 20


@dataclass
class Check:
    check: str
    status: str  # "ok" | "warn" | "fail"
    message: str
    figures: dict[str, Any] = field(default_factory=dict)


async def check_node(addr: str, token: str | None, timeout: float,
                     dial: dict[str, Any] | None = None) -> list[Check]:
    """Every check against one node, stopping where the next cannot run."""
    import rpcbuf

    out: list[Check] = []
    t0 = time.perf_counter()
    try:
        host, port = parse_addr(addr)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.close()
    except RpcBufError as exc:  # an address that does not parse
        out.append(Check("reachable", "fail", sentence(addr, exc)))
        return out
    except (OSError, TimeoutError) as exc:
        err = rpcbuf.ConnectionLost(f"cannot reach rpcbufd at {addr}: {exc}")
        err.__cause__ = exc
        out.append(Check("reachable", "fail", sentence(addr, err)))
        return out
    ms = (time.perf_counter() - t0) * 1e3
    out.append(Check("reachable", "ok", f"{addr} accepts connections ({ms:.1f} ms)",
                     {"connect_ms": ms}))
    dial = dial or {}
    try:
        tls = tls_context(dial.get("tls"))
    except RpcBufError as exc:
        out.append(Check("tls", "fail", sentence(addr, exc)))
        return out
    insecure = insecure_default() if dial.get("insecure") is None else dial["insecure"]
    if tls is not None:
        out.append(Check("tls", "ok", "TLS: the node must present a certificate for "
                         f"{host} from the CA this client trusts before it gets the token"))
    elif is_loopback(host):
        out.append(Check("tls", "ok", "plain TCP on loopback (nothing leaves this host)"))
    elif insecure:
        out.append(Check("tls", "warn", "the control channel is plain TCP (--insecure): the "
                         "token travels in the clear to whoever answers; run the daemon with "
                         "--tls-cert/--tls-key and pass --ca (docs/security.md)"))
    if token is None:  # what needs no token was checked: the rest needs one
        rdma = rdma_devices()
        out.extend(c for c in ucx_checks(ucx.library(), None, rdma, [])
                   if c.check != "ucx node")
        out.append(Check("token", "fail", "no token: pass --token or set RPCBUF_TOKEN "
                         "(`rpcbuf token create` makes one); the checks of the session "
                         "need one"))
        return out
    try:
        ctx = await rpcbuf.connect(addr, token=token, timeout=timeout, **dial)
    except UcxUnusable:  # this side's UCX (RPCBUF_UCX) was refused: show what it is
        rdma = rdma_devices()
        out.append(Check("transports", "ok", f"RDMA devices: {', '.join(rdma) or 'none'} here",
                         {"rdma_devices": rdma}))
        out.extend(c for c in ucx_checks(ucx.library(), None, rdma, [])
                   if c.check == "ucx here")
        return out
    except RpcBufError as exc:  # refused before the token went out: a TLS failure
        tls_why = exc.details.get("reason") in ("insecure_transport", "tls", "tls_required")
        out.append(Check("tls" if tls_why else "token", "fail", sentence(addr, exc)))
        return out
    try:
        await _with_session(ctx, addr, out, tls is not None)
    except RpcBufError as exc:  # the node went away or refused midway
        out.append(Check("session", "fail", sentence(addr, exc)))
    finally:
        await ctx.close()
    return out


async def _with_session(ctx: Any, addr: str, out: list[Check], dialed_tls: bool = False
                        ) -> None:
    hello = ctx.hello
    exp = hello.get("token_expires_at")
    if exp is None:
        out.append(Check("token", "ok", f"accepted: tenant {hello['tenant']}, never expires"))
    else:
        left = float(exp) - time.time()
        status = "ok" if left > 3600 else "warn"
        more = "" if status == "ok" else ": make a new one soon (`rpcbuf token create`)"
        out.append(Check("token", status, f"accepted: tenant {hello['tenant']}, expires in "
                         f"{ago(left)}{more}", {"expires_in_s": left}))
    version = hello.get("version")
    out.append(Check("protocol", "ok" if version == P.PROTOCOL_VERSION else "warn",
                     f"node speaks protocol {version}, this client {P.PROTOCOL_VERSION}"))
    if ctx.same_host:
        out.append(Check("data path", "ok", "same-host (shared memory over the node's Unix "
                         "socket: your arrays are copied through a staging area the daemon "
                         "made; no UCX)"))
    else:
        why = hello.get("same_host_why")
        local = "local" in hello or is_loopback(parse_addr(addr)[0])
        if local and not why:  # the two reasons the daemon cannot give: say them here
            if "local" not in hello:
                why = "the daemon offers no same-host socket (it runs with --local-socket none)"
            elif same_host_default() is False:
                why = "RPCBUF_SAME_HOST=0 here"
            elif dialed_tls:
                why = ("this client dialed TLS, and the same-host path (a Unix socket) leaves "
                       "TLS out, so it is taken only when asked for: RPCBUF_SAME_HOST=1")
        msg = "UCX" + (f" (same-host path not used: {why})" if why else "")
        if local and why:
            msg += ("; on one host UCX moves every byte through loopback TCP, several times "
                    "slower than the same-host path's shared memory (the round trips below "
                    "show what it costs)")
        out.append(Check("data path", "warn" if local and why else "ok", msg))
    tls = os.environ.get("UCX_TLS", "") or "(UCX's choice)"
    rdma = rdma_devices()
    st = await ctx.stats()
    node_tls = str(st.get("ucx_tls") or "(UCX's choice)")
    node_rdma = [str(d) for d in st.get("rdma_devices") or []]
    out.append(Check("transports", "ok",
                     f"UCX_TLS={tls} here, {node_tls} on the node; RDMA devices: "
                     f"{', '.join(rdma) or 'none'} here, {', '.join(node_rdma) or 'none'} "
                     "on the node",
                     {"ucx_tls": tls, "rdma_devices": rdma, "node_ucx_tls": node_tls,
                      "node_rdma_devices": node_rdma}))
    out.extend(ucx_checks(ucx.library(), st.get("ucx"), rdma, node_rdma))
    listening = [str(a) for a in st.get("listening") or []]
    wild = [a for a in listening if a.startswith(("0.0.0.0:", "[::]:"))]
    out.append(Check("listening", "warn" if wild else "ok",
                     f"the node listens on {' '.join(listening) or '(not told)'}" + (
                         f"; {' '.join(wild)} on every interface (ucxx's listener takes no "
                         "address: firewall it off untrusted networks)" if wild else ""),
                     {"listening": listening}))
    devices = await ctx.list_devices()
    host = [d for d in devices if d.get("device_type", "CPU") == "CPU"] or devices
    await _round_trips(ctx, out, max((int(d["largest_free"]) for d in host), default=0))
    for d in devices:
        free, total = int(d["free"]), int(d["total"])
        status = "ok" if total and free >= total // 10 else "warn"
        out.append(Check(f"memory {d['key']}", status, f"{format_size(free)} free of "
                         f"{format_size(total)} (largest block {format_size(d['largest_free'])})",
                         {"free": free, "total": total}))
    ram = st.get("host_ram")
    arenas = sum(int(d["total"]) for d in devices if str(d["key"]).startswith("cpu"))
    if isinstance(ram, int) and ram > 0 and arenas > ram:
        out.append(Check("memory host", "warn", f"the host arenas add up to "
                         f"{format_size(arenas)}, more than the node's {format_size(ram)} of "
                         "memory: clients run out of memory before the arenas are full "
                         "(rpcbufd --device cpu:SIZE)", {"arenas": arenas, "host_ram": ram}))
    t0 = time.time()
    pong = await ctx._call(P.Ping())  # the node's clock (ping() gives the round trip)
    t1 = time.time()
    skew = float(pong["time"]) - (t0 + t1) / 2
    status = "ok" if abs(skew) < 1 else "warn" if abs(skew) < 30 else "fail"
    out.append(Check("clock", status, f"the node's clock is {abs(skew) * 1e3:.0f} ms "
                     f"{'ahead' if skew > 0 else 'behind'}" + (
                         "" if status == "ok" else ": token expiry is judged by the node's "
                         "clock; run NTP (chrony) on both"), {"skew_s": skew}))


async def _round_trips(ctx: Any, out: list[Check], largest: int) -> None:
    """A 4 KiB and a 64 MiB (or the largest free block's) store + read, each
    the best of three after a warm-up."""
    big = min(BIG, largest)
    for size in (4096, big):
        label = format_size(size)
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        back = np.empty_like(data)
        try:
            bid = await ctx.request_buffer(size)
        except RpcBufError as exc:
            out.append(Check(f"round trip {label}", "warn", f"not run: {exc.message}"))
            continue
        best = [float("inf"), float("inf")]
        try:
            for i in range(4):
                t0 = time.perf_counter()
                await ctx.store_tensor(bid, data, verify="checksum")
                t1 = time.perf_counter()
                await ctx.read_buffer(bid, out=back)
                t2 = time.perf_counter()
                if i:
                    best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
        except RpcBufError as exc:
            out.append(Check(f"round trip {label}", "fail", exc.message))
            continue
        finally:
            await asyncio.shield(ctx.release_buffer(bid))
        if not np.array_equal(back, data):
            out.append(Check(f"round trip {label}", "fail", "read back differs from what "
                             "was stored"))
            continue
        store, read = best
        if size > 1 << 20:
            msg = f"store {format_size(size / store)}/s, read {format_size(size / read)}/s"
        else:
            msg = f"store + ack {store * 1e6:.0f} us, read {read * 1e6:.0f} us"
        if size < BIG and size == big:
            msg += " (the largest free block)"
        out.append(Check(f"round trip {label}", "ok", msg,
                         {"store_s": store, "read_s": read, "bytes": size}))


async def doctor(endpoints: list[str], token: str | None, timeout: float,
                 dial: dict[str, Any] | None = None) -> dict[str, list[Check]]:
    results = await asyncio.gather(*(check_node(a, token, timeout, dial) for a in endpoints))
    return dict(zip(endpoints, results, strict=True))


def render(results: dict[str, list[Check]], columns: int | None = None) -> list[str]:
    """One line per check, every part ``clean``: a malicious node's escape
    sequences must not reach the terminal."""
    from rpcbuf.cli.tables import clean, fold, width

    mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}
    # The labels' column as wide as the widest ("round trip 64.0 MiB" ran
    # into its sentence), the sentences folded between words and a path
    # after its slashes (``fold``), under themselves.
    label = max([18] + [len(clean(c.check, limit=64)) for cs in results.values() for c in cs])
    indent = 2 + 4 + 2 + label + 1
    room = max(30, (width() if columns is None else columns) - indent)
    lines: list[str] = []
    for addr, checks in results.items():
        lines.append(clean(addr))
        for c in checks:
            text = fold(clean(c.message), room) or [""]
            lines.append(f"  {mark.get(c.status, '?   ')}  {clean(c.check, limit=64):<{label}} "
                         f"{text[0]}")
            lines += [" " * indent + more for more in text[1:]]
    return lines


def as_json(results: dict[str, list[Check]]) -> dict[str, Any]:
    return {a: [asdict(c) for c in checks] for a, checks in results.items()}


def failed(results: dict[str, list[Check]]) -> bool:
    return any(c.status == "fail" for checks in results.values() for c in checks)


def ucx_checks(here: dict[str, Any], node: Any, rdma: list[str],
               node_rdma: list[str]) -> list[Check]:
    """Each side's UCX (path, version, RDMA), warning where it cannot use what
    the host has or ``UCX_NET_DEVICES`` names an unseen device."""
    out: list[Check] = []
    for side, lib, devs in (("here", here, rdma), ("node", node, node_rdma)):
        if not isinstance(lib, dict):
            out.append(Check(f"ucx {side}", "warn", "the node does not say which UCX it runs"))
            continue
        built = ", ".join(f"{k} {'yes' if lib.get(k) else 'no'}"
                          for k in ("verbs", "rdmacm", "cuda"))
        msg = f"UCX {lib.get('version') or '?'} ({built}) at {lib.get('path') or '?'}"
        if not lib.get("verbs"):
            msg += ": no RDMA with this build"
        status = "ok"
        if lib.get("error"):
            hint = "" if str(lib["error"]).startswith("UnusableUCX") else \
                " (check UCX_NET_DEVICES and UCX_TLS)"
            out.append(Check(f"ucx {side}", "fail", f"UCX does not start: {lib['error']}{hint}; "
                             f"{msg}", {"ucx": lib}))
            continue
        if devs and not lib.get("verbs"):
            status = "warn"
            msg += (f"; RDMA devices {', '.join(devs)} are there, but this UCX was built "
                    "without verbs (the pip wheel is): see docs/dataplane.md")
        out.append(Check(f"ucx {side}", status, msg, {"ucx": lib}))
    wanted = [d.strip() for d in os.environ.get("UCX_NET_DEVICES", "").split(",") if d.strip()]
    seen = {r.split("/", 1)[1] for r in here.get("resources") or [] if "/" in r}
    missing = [d for d in wanted if d != "all" and d not in seen]
    if missing and not here.get("error"):  # a UCX that did not start sees nothing: said above
        out.append(Check("ucx devices", "warn",
                         f"UCX_NET_DEVICES names {', '.join(missing)}, which this UCX does not "
                         f"see (it sees {', '.join(sorted(seen)) or 'none'})"))
    tls = [t.strip() for t in os.environ.get("UCX_TLS", "").split(",") if t.strip()]
    if rdma and tls and all(t in ("tcp", "self", "sm", "posix", "sysv", "cma") or
                            t.startswith("cuda") for t in tls):
        out.append(Check("ucx transports", "warn",
                         f"UCX_TLS={','.join(tls)} leaves RDMA out although this host has "
                         f"{', '.join(rdma)}"))
    return out
