"""`weightsync push` on a terminal shows its progress; with --json it prints one JSON
object and nothing else, even on a terminal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from safetensors.torch import save_file

from examples.tiny import perturbed

from .helpers import running_daemon

pytestmark = pytest.mark.slow
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def under_pty(args: list[str]) -> tuple[int, str, str]:
    """Run `weightsync ARGS` with stdout on a pseudo-terminal; (exit code, screen text, stderr)."""
    master, slave = os.openpty()
    p = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        stdout=slave,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "160", "TERM": "xterm"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    err = p.stderr.read().decode(errors="replace")
    return p.wait(60), ANSI.sub("", b"".join(chunks).decode(errors="replace")), err


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    with running_daemon(tmp_path_factory.mktemp("progress"), tiny_model_dir, engines=1) as c:
        yield c


def ckpt(tmp_path, tiny_state, v):
    d = tmp_path / f"v{v}"
    d.mkdir()
    save_file(dict(perturbed(tiny_state, v)), str(d / "model.safetensors"))
    return d


def next_version(cluster) -> int:
    """The tests share one daemon and run in any order."""
    return (cluster.status()["last_ready_version"] or 0) + 1


def test_push_on_a_terminal_shows_progress(cluster, tmp_path, tiny_state):
    v = next_version(cluster)
    code, screen, err = under_pty(
        [
            "push",
            str(ckpt(tmp_path, tiny_state, v)),
            "--version",
            str(v),
            "--addr",
            cluster.addr,
            "--bucket-bytes",
            "65536",
        ]
    )
    assert code == 0, err
    assert f"v{v}" in screen and "buckets applied by every engine" in screen, screen[-2000:]
    assert re.search(r"\d+(\.\d+)? ?[kM]B", screen), screen[-2000:]  # bytes moved, as a size
    assert f"version {v} READY" in screen


def test_push_json_on_a_terminal_is_only_json(cluster, tmp_path, tiny_state):
    v = next_version(cluster)
    code, screen, err = under_pty(
        [
            "push",
            str(ckpt(tmp_path, tiny_state, v)),
            "--version",
            str(v),
            "--addr",
            cluster.addr,
            "--bucket-bytes",
            "65536",
            "--json",
        ]
    )
    assert code == 0, err
    out = json.loads(screen.strip())
    assert out["ok"] is True and out["state"] == "READY" and out["version"] == v
