"""A holding engine's default id is the same for a holder restarted in the same place (a
new process), so the daemon keeps one record of it instead of one per restart."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest

from engines.holding import holder_id
from messages.schema import MAX_ID_LEN, Id
from orchestrator.daemon.config import child_env

SCRIPT = """
import pathlib, sys
from engines.holding import HoldingReceiver
kw = {"rank": int(sys.argv[4])} if len(sys.argv) > 4 else {}
r = HoldingReceiver(sys.argv[1], sys.argv[2], **kw)
pathlib.Path(sys.argv[3]).write_text(r.engine_id)  # not stdout: the worker thread logs there
r.close()
"""


def default_id(model_dir, connect, *rank: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "engine_id"
        subprocess.run(
            [sys.executable, "-c", SCRIPT, str(model_dir), connect, str(out), *rank],
            capture_output=True,
            timeout=120,
            env=child_env(),
            check=True,
        )
        return out.read_text()


def test_the_default_holder_id_survives_a_restart_and_names_host_and_rank(tmp_path, tiny_model_dir):
    connect = f"ipc://{tmp_path}/nobody.sock"  # no daemon: the id is chosen before it registers
    first, again = default_id(tiny_model_dir, connect), default_id(tiny_model_dir, connect)
    assert first == again, (first, again)
    host = first.removesuffix("-holding-0")
    assert host != first and host, first  # {host}-holding-{rank}
    assert default_id(tiny_model_dir, connect, "3") == f"{host}-holding-3"
    # the host part is this host's name wherever that name is a valid id
    plain = socket.gethostname()
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,100}", plain):
        assert host == plain


@pytest.mark.parametrize(
    "hostname",
    ["2026-12-06 build host", "", "-.lead", "h" * 300, "ünïcode.local", "node 7 (gpu)"],
)
def test_any_host_name_gives_an_id_the_daemon_accepts(monkeypatch, hostname):
    """Whatever the machine calls itself (spaces, nothing, 300 characters, non-ASCII), the
    default id is a valid engine id that still ends in -{name}-{rank}."""
    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    got = holder_id("holding", 7)
    msgspec.convert(got, Id)  # raises msgspec.ValidationError when the daemon would refuse it
    assert got.endswith("-holding-7") and len(got) <= MAX_ID_LEN
