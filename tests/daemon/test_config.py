"""``--config FILE.toml``: same settings as the flags, flags win, bad files
fail at start with the key's name, SIGHUP's reload changes only what it may."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from rpcbuf.control.daemon.accounting.registry import Quota
from rpcbuf.control.daemon.service import config
from rpcbuf.control.daemon.service.main import build_parser

EXAMPLE = ROOT / "scripts" / "systemd" / "rpcbufd.toml"
INTERNAL = {"config", "command_line", "from_file"}


def resolve(*argv: str) -> argparse.Namespace:
    return config.resolve(build_parser(), list(argv))


def settings(ns: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(ns).items() if k not in INTERNAL}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "rpcbufd.toml"
    path.write_text(text)
    return str(path)


FULL = """
listen = "10.0.0.5:7800"
ucx_port = 7801
node_id = "n1"
secret_file = "/etc/rpcbuf/secret"
devices = ["cpu:1GiB", "cpu:1:512MiB"]
model_dirs = ["/srv/models", "/data/hf"]
allocator = "slab"
metrics = "0.0.0.0:9100"
[limits]
max_frame = "2MiB"
max_inflight = 8
max_sessions = 100
transfer_timeout = "1m"
drain_timeout = 5
[log]
level = "DEBUG"
format = "json"
audit = "/var/log/rpcbuf/audit.log"
[tls]
cert = "/c.pem"
key = "/k.pem"
[quotas]
"*" = { bytes = "1GiB", buffers = 10 }
alice = { bytes = 4096, buffers = "-" }
bob = { buffers = 0 }
"""

SAME_AS_FLAGS = [
    "--listen", "10.0.0.5:7800", "--ucx-port", "7801", "--node-id", "n1",
    "--secret-file", "/etc/rpcbuf/secret", "--device", "cpu:1GiB", "--device", "cpu:1:512MiB",
    "--model-dir", "/srv/models", "--model-dir", "/data/hf",
    "--allocator", "slab", "--metrics", "0.0.0.0:9100", "--max-frame", "2MiB",
    "--max-inflight", "8", "--max-sessions", "100", "--transfer-timeout", "1m",
    "--drain-timeout", "5", "--log-level", "DEBUG", "--log-format", "json",
    "--audit-log", "/var/log/rpcbuf/audit.log", "--tls-cert", "/c.pem", "--tls-key", "/k.pem",
    "--default-quota", "*:1GiB:10", "--quota", "alice:4096:-", "--quota", "bob:-:0",
]


def test_a_file_gives_exactly_the_settings_its_flags_give(tmp_path: Path) -> None:
    from_file = resolve("--config", write(tmp_path, FULL))
    assert settings(from_file) == settings(resolve(*SAME_AS_FLAGS))
    assert from_file.quota == [("alice", Quota(4096, None)), ("bob", Quota(None, 0))]
    assert from_file.default_quota == ("*", Quota(1 << 30, 10))


def test_the_example_file_is_valid_and_says_the_defaults(tmp_path: Path) -> None:
    ns = resolve("--config", str(EXAMPLE))
    # Issue 28, item 11: it listened on 0.0.0.0 with TLS commented out.
    assert ns.secret_file == "/etc/rpcbuf/secret" and ns.listen == ("127.0.0.1", 7700)
    assert ns.tls_cert is None  # so: loopback, until [tls] is filled in
    text = EXAMPLE.read_text()
    assert "refuses it" not in text and "own user only" not in text  # not true (README, unit)
    defaults = resolve("--secret-file", "s")
    for key in ("max_frame", "max_inflight", "max_sessions", "transfer_timeout",
                "drain_timeout", "allocator", "log_level", "log_format", "ucx_port"):
        assert getattr(ns, key) == getattr(defaults, key), key


def test_flags_beat_the_file_and_quotas_merge_per_tenant(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    ns = resolve("--config", path, "--max-inflight", "3", "--device", "cpu:1MiB",
                 "--quota", "alice:1MiB:5", "--log-level", "WARNING")
    assert ns.max_inflight == 3 and ns.log_level == "WARNING"
    assert ns.device == [("cpu", 0, 1 << 20)]  # --device replaces the file's list
    assert dict(ns.quota) == {"alice": Quota(1 << 20, 5), "bob": Quota(None, 0)}
    assert ns.max_sessions == 100  # untouched keys still come from the file


@pytest.mark.parametrize(("text", "key"), [
    ("listn = \"1.2.3.4:5\"", "'listn'; did you mean 'listen'"),
    ("device = [\"cpu:1GiB\"]", "'device'; did you mean 'devices'"),
    ("model_dir = [\"/m\"]", "'model_dir'; did you mean 'model_dirs'"),
    ("model_dirs = \"/m\"", "model_dirs: want a list"),
    ("log_level = \"INFO\"", "'log_level'"),
    ("[limits]\nmax_frames = 1", "'limits.max_frames'; did you mean 'limits.max_frame'"),
    ("[bogus]\nx = 1", "'bogus'"),
    ("[limits]\nmax_frame = \"huge\"", "limits.max_frame: bad size 'huge'"),
    ("[limits]\nmax_inflight = 0", "limits.max_inflight: '0' must be at least 1"),
    ("[limits]\nmax_sessions = 1.5", "limits.max_sessions: '1.5' is not a whole number"),
    ("[limits]\ntransfer_timeout = \"soon\"", "limits.transfer_timeout: bad duration"),
    ("[limits]\ndrain_timeout = true", "limits.drain_timeout: want a string or a number"),
    ("[log]\nlevel = \"LOUD\"", "log.level: 'LOUD' is not one of"),
    ("[log]\nformat = \"xml\"", "log.format: 'xml' is not one of"),
    ("allocator = \"magic\"", "allocator: 'magic' is not one of"),
    ("listen = \"127.0.0.1:x\"", "listen: bad address"),
    ("metrics = [1]", "metrics: want a string or a number"),
    ("devices = \"cpu:1GiB\"", "devices: want a list"),
    ("devices = [\"cpu:lots\"]", "devices[0]: --device 'cpu:lots': bad size"),
    ("limits = 3", "limits: want a [limits] table"),
    ("[quotas]\nalice = \"1GiB\"", "quotas.alice: want"),
    ("[quotas]\nalice = { bytes = \"x\" }", "quotas.alice.bytes: bad size"),
    ("[quotas]\nalice = { buffers = -1 }", "quotas.alice.buffers: want a whole number"),
    ("[quotas]\nalice = { size = 1 }", "quotas.alice.size: unknown key"),
    ("[quotas]\n\"a b\" = { buffers = 1 }", "quotas.a b: not a tenant name"),
    ("listen = ", "not valid TOML"),
])
def test_bad_files_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, "secret_file = \"s\"\n" + text + "\n")
    with pytest.raises(config.ConfigError) as info:
        resolve("--config", path)
    assert key in str(info.value) and path in str(info.value)


def test_required_and_paired_settings() -> None:
    with pytest.raises(config.ConfigError, match="secret file is required"):
        resolve()
    with pytest.raises(config.ConfigError, match="--tls-cert and --tls-key"):
        resolve("--secret-file", "s", "--tls-cert", "c.pem")
    with pytest.raises(config.ConfigError, match="cannot read it"):
        resolve("--config", "/nonexistent/rpcbufd.toml")


def test_reload_changes_quotas_and_level_and_names_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    ns = resolve("--config", path, "--quota", "carol:1MiB:1")
    Path(path).write_text(FULL.replace('bob = { buffers = 0 }', 'dave = { buffers = 2 }')
                          .replace('"DEBUG"', '"ERROR"').replace("max_inflight = 8", "")
                          .replace("7801", "7901"))
    restart = config.reload(ns, build_parser())
    assert dict(ns.quota) == {"alice": Quota(4096, None), "dave": Quota(None, 2),
                              "carol": Quota(1 << 20, 1)}  # the flag's tenant stays
    assert ns.log_level == "ERROR"
    assert restart == ["max_inflight", "ucx_port"]  # read at start only: reported, not applied
    assert ns.ucx_port == 7801 and ns.max_inflight == 8


def test_reload_keeps_flags_and_fails_whole(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    ns = resolve("--config", path, "--log-level", "INFO")
    Path(path).write_text(FULL.replace('"DEBUG"', '"ERROR"'))
    config.reload(ns, build_parser())
    assert ns.log_level == "INFO"  # the command line still wins
    before = list(ns.quota)
    Path(path).write_text(FULL + "\n[limits2]\n")
    with pytest.raises(config.ConfigError, match="limits2"):
        config.reload(ns, build_parser())
    assert ns.quota == before


def run_daemon(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.control.daemon", *args],
                          capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(("setup", "message"), [
    ("[limits]\nmax_inflight = -1", "limits.max_inflight"),
    ("colour = \"blue\"", "unknown key 'colour'"),
    ("", "secret file is required"),
])
def test_the_daemon_refuses_a_bad_file_with_exit_2(tmp_path: Path, setup: str,
                                                   message: str) -> None:
    res = run_daemon("--config", write(tmp_path, setup + "\n"))
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr


def test_a_setting_from_the_file_is_named_by_its_key(tmp_path: Path) -> None:
    """Issue 28, item 11: the example, started by hand, said `--audit-log
    /var/log/rpcbuf/audit.log: No such file or directory` (a flag the user
    never gave)."""
    path = write(tmp_path, 'listen = "127.0.0.1:0"\nucx_port = 0\ndevices = ["cpu:1MiB"]\n'
                 f'secret_file = "{tmp_path / "s"}"\n[log]\naudit = "/nonexistent/dir/a.log"\n')
    res = run_daemon("--config", path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f'log.audit = "/nonexistent/dir/a.log" (in {path}): No such file' in res.stderr, \
        res.stderr


def test_a_missing_tls_file_from_the_file_is_named_by_its_key(tmp_path: Path) -> None:
    """Issue 37 item 11: a TLS file missing from the config's [tls] section
    was named as --tls-cert (a flag the user never gave)."""
    path = write(tmp_path, 'listen = "127.0.0.1:0"\nucx_port = 0\ndevices = ["cpu:1MiB"]\n'
                 f'secret_file = "{tmp_path / "s"}"\n[tls]\ncert = "/nonexistent/c.pem"\n'
                 'key = "/nonexistent/k.pem"\n')
    res = run_daemon("--config", path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f'tls.cert = "/nonexistent/c.pem" (in {path}): no such file' in res.stderr, res.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-sessions", "0"], "must be at least 1"),
    (["--metrics", "127.0.0.1:x"], "bad address"),
    (["--log-format", "xml"], "invalid choice"),
    (["--audit-log", "/nonexistent/dir/audit.log"], "--audit-log /nonexistent/dir/audit.log"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"],
     "--tls-cert /nonexistent.pem: no such file"),
])
def test_bad_service_flags_fail_clearly(tmp_path: Path, flags: list[str], message: str) -> None:
    res = run_daemon("--secret-file", str(tmp_path / "s"), "--device", "cpu:1MiB", *flags)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr


def test_a_missing_model_dir_stops_the_daemon_at_start(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "rpcbuf.control.daemon", "--secret-file",
                          str(tmp_path / "s"), "--model-dir", str(tmp_path / "nope"),
                          "--listen", "127.0.0.1:0", "--ucx-port", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--model-dir" in res.stderr and "not a directory" in res.stderr
