"""``rpcbufd --config FILE.toml``: the daemon's settings from a TOML file.

Every key is a flag's and goes through the flag's argparse ``type`` and
``choices``, so a new flag is a new key with no code here (a few keys sit in
sections: ``[limits]``, ``[log]``, ``[tls]``, ``[quotas]``, ``[registry]``). A flag
beats the file, the file the default; ``--quota`` overrides only its tenant.
Unknown keys and bad values raise ``ConfigError`` naming the key (exit 2).
``reload`` changes only what is safe under running clients and names the rest.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Sequence
from typing import Any

from rpcbuf.control.daemon.accounting.registry import Quota
from rpcbuf.control.wire.auth import TENANT_RE
from rpcbuf.control.wire.units import parse_size

# (section, key) -> argparse dest, for keys that do not sit at the top level.
SECTIONED: dict[tuple[str, str], str] = {
    ("limits", "max_frame"): "max_frame",
    ("limits", "max_inflight"): "max_inflight",
    ("limits", "max_sessions"): "max_sessions",
    ("limits", "max_sessions_per_tenant"): "max_sessions_per_tenant",
    ("limits", "hello_timeout"): "hello_timeout",
    ("limits", "max_unauthenticated"): "max_unauthenticated",
    ("limits", "max_unauthenticated_per_source"): "max_unauthenticated_per_source",
    ("limits", "transfer_timeout"): "transfer_timeout",
    ("limits", "copy_threads"): "copy_threads",
    ("limits", "max_fds_per_tenant"): "max_fds_per_tenant",
    ("limits", "fd_reserve"): "fd_reserve",
    ("limits", "max_buffered_per_tenant"): "max_buffered_per_tenant",
    ("limits", "frame_timeout"): "frame_timeout",
    ("limits", "drain_timeout"): "drain_timeout",
    ("log", "level"): "log_level",
    ("log", "format"): "log_format",
    ("log", "audit"): "audit_log",
    ("tls", "cert"): "tls_cert",
    ("tls", "key"): "tls_key",
    ("registry", "url"): "registry",
    ("registry", "advertise"): "advertise",
    ("registry", "cluster"): "cluster",
    ("registry", "ttl"): "registry_ttl",
    ("registry", "ca"): "registry_ca",
    ("registry", "cert"): "registry_cert",
    ("registry", "key"): "registry_key",
    ("registry", "user"): "registry_user",
    ("registry", "password_file"): "registry_password_file",
}
# top-level key -> dest, where the plural reads better
ALIASES = {"devices": "device", "model_dirs": "model_dir"}
# quotas: the [quotas] table
NOT_IN_FILE = {"help", "config", "quota", "default_quota"}
RELOADABLE = ("quota", "default_quota", "log_level")


def setting(args: argparse.Namespace, dest: str, flag: str, shown: str) -> str:
    """How an error names a setting: ``--flag VALUE``, or ``key = "VALUE" (in FILE)``
    where the value came from the file."""
    if dest not in getattr(args, "from_file", ()) or dest in getattr(args, "command_line", {}):
        return f"{flag} {shown}"
    key = next((f"{s}.{k}" for (s, k), d in SECTIONED.items() if d == dest), None)
    key = key or next((k for k, d in ALIASES.items() if d == dest), dest)
    return f'{key} = "{shown}" (in {args.config})'


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and key."""


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != argparse.SUPPRESS}


def known_keys(parser: argparse.ArgumentParser) -> list[str]:
    """Every key a config file may hold, as ``section.key`` for sectioned ones."""
    in_sections = set(SECTIONED.values())
    dest_to_alias = {v: k for k, v in ALIASES.items()}
    top = [dest_to_alias.get(d, d) for d in _actions(parser)
           if d not in NOT_IN_FILE and d not in in_sections]
    return sorted([*top, *(f"{s}.{k}" for s, k in SECTIONED), "quotas.TENANT"])


def _unknown(key: str, parser: argparse.ArgumentParser) -> ConfigError:
    keys = known_keys(parser)
    hint = difflib.get_close_matches(key, keys, n=1)
    extra = f"; did you mean {hint[0]!r}?" if hint else f" (known keys: {', '.join(keys)})"
    return ConfigError(f"unknown key {key!r}{extra}")


def _convert(key: str, action: argparse.Action, value: Any) -> Any:
    """Turn a TOML value into what the flag's own ``type`` makes of its text."""
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: want true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: want a list, e.g. [\"...\"], got {value!r}")
        return [_scalar(f"{key}[{i}]", action, v) for i, v in enumerate(value)]
    return _scalar(key, action, value)


def _scalar(key: str, action: argparse.Action, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{key}: want a string or a number, got {value!r}")
    text = value if isinstance(value, str) else repr(value)
    try:
        out = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if action.choices is not None and out not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{key}: {value!r} is not one of {choices}")
    return out


def _quotas(table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError("quotas: want a table of TENANT = { bytes = ..., buffers = ... }")
    quota: list[tuple[str, Quota]] = []
    default: tuple[str, Quota] | None = None
    for tenant, spec in table.items():
        key = f"quotas.{tenant}"
        if tenant != "*" and not TENANT_RE.fullmatch(tenant):
            raise ConfigError(f"{key}: not a tenant name (letters, digits and _.@- only; "
                              "\"*\" for everyone else)")
        if not isinstance(spec, dict):
            raise ConfigError(f"{key}: want {{ bytes = \"8GiB\", buffers = 1000 }}")
        for k in spec:
            if k not in ("bytes", "buffers"):
                raise ConfigError(f"{key}.{k}: unknown key (known: bytes, buffers)")
        nbytes, count = spec.get("bytes", "-"), spec.get("buffers", "-")
        try:
            size = None if nbytes == "-" else parse_size(str(nbytes))
        except ValueError as exc:
            raise ConfigError(f"{key}.bytes: {exc}") from None
        if count != "-" and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ConfigError(f"{key}.buffers: want a whole number >= 0 or \"-\", got {count!r}")
        q = Quota(size, None if count == "-" else count)
        if tenant == "*":
            default = (tenant, q)
        else:
            quota.append((tenant, q))
    return {"quota": quota, "default_quota": default}


def load(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read ``path``; return {argparse dest: value}. Raises ConfigError."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config {path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: not valid TOML: {exc}") from None
    try:
        return _settings(data, parser)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from None


def _settings(data: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    actions = _actions(parser)
    sections = {s for s, _ in SECTIONED}
    in_sections = set(SECTIONED.values())
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "quotas":
            out.update(_quotas(value))
        elif key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: want a [{key}] table")
            for sub, v in value.items():
                dest = SECTIONED.get((key, sub))
                if dest is None or dest not in actions:
                    raise _unknown(f"{key}.{sub}", parser)
                out[dest] = _convert(f"{key}.{sub}", actions[dest], v)
        else:
            dest = ALIASES.get(key, key)
            if dest not in actions or dest in NOT_IN_FILE or dest in in_sections \
                    or (dest in ALIASES.values() and key not in ALIASES):
                raise _unknown(key, parser)
            out[dest] = _convert(key, actions[dest], value)
    return out


def _given(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The dests set on the command line itself (not by a default)."""
    unset = object()
    actions = _actions(parser)
    ns = argparse.Namespace(**{d: None if isinstance(a, argparse._AppendAction) else unset
                               for d, a in actions.items()})
    parser.parse_args(argv, ns)
    return {d for d, v in vars(ns).items() if v is not unset and v is not None}


def resolve(parser: argparse.ArgumentParser,
            argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags over the file over defaults. ConfigError; argparse exits 2 on a bad flag."""
    args = parser.parse_args(argv)
    given = _given(parser, argv)
    args.command_line = {d: getattr(args, d) for d in given}
    args.from_file = set()
    if args.config:
        for dest, value in load(args.config, parser).items():
            args.from_file.add(dest)
            if dest == "quota":
                args.quota = [*value, *args.command_line.get("quota", [])]
            elif dest not in given:
                setattr(args, dest, value)
    if not args.secret_file:
        raise ConfigError("a secret file is required: --secret-file F or secret_file = \"F\" "
                          "in the --config file")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key (tls.cert and tls.key) go together")
    if bool(args.registry_cert) != bool(args.registry_key):
        raise ConfigError("--registry-cert and --registry-key (registry.cert and registry.key) "
                          "go together")
    return args


def reload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Re-read the file into the reloadable settings of ``args`` (flags still win);
    return the other keys that changed (they need a restart). ConfigError changes nothing."""
    fresh = load(args.config, parser)
    cli = args.command_line
    args.quota = [*fresh.get("quota", []), *cli.get("quota", [])]
    if "default_quota" not in cli:
        args.default_quota = fresh.get("default_quota")
    if "log_level" not in cli:
        args.log_level = fresh.get("log_level", parser.get_default("log_level"))
    keys = (set(fresh) | args.from_file) - set(RELOADABLE) - set(cli)
    args.from_file = set(fresh)
    return sorted(d for d in keys if fresh.get(d, parser.get_default(d)) != getattr(args, d, None))
