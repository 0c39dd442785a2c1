"""Each side pointed at the daemon's other socket exits at once with one line naming the
socket it reached and the one to use (issue 44, item 5): an engine at the trainer socket,
`weightsync status` / `push` and TrainerClient at the engine socket. The daemon binds the
wildcard host on TCP, as a multi-host daemon does; the line names the host the client used."""

from __future__ import annotations

import json
import socket
import time

import pytest
from safetensors.torch import save_file

from examples.launch import spawn
from examples.tiny import perturbed
from messages.errors import ErrorCode, PeerError
from orchestrator.trainer.client import TrainerClient

from .helpers import wait_for, ws


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon on tcp://0.0.0.0 (no engines needed: nothing here may register)."""
    d = tmp_path_factory.mktemp("wrong-socket")
    tport, eport = free_port(), free_port()
    p = spawn(
        "daemon",
        [
            "serve",
            "--bind",
            f"tcp://0.0.0.0:{tport}",
            "--engine-bind",
            f"tcp://0.0.0.0:{eport}",
            "--fanout-bind",
            "off",
            "--state-db",
            str(d / "state.db"),
        ],
        d / "logs",
    )
    trainer, engine = f"tcp://127.0.0.1:{tport}", f"tcp://127.0.0.1:{eport}"

    def up():
        with TrainerClient(trainer, timeout=1.0, retries=0, connect_timeout=1.0) as c:
            try:
                return c.status()
            except Exception:
                return None

    try:
        wait_for(lambda: p.popen.poll() is not None or up(), 60, "the daemon answers status")
        assert p.popen.poll() is None, p.log_tail()
        yield trainer, engine, d
    finally:
        p.stop()
        print(f"----- daemon log -----\n{p.log_tail(30)}")


def test_an_engine_at_the_trainer_socket_exits_3_naming_the_engine_socket(daemon, tiny_model_dir):
    trainer, engine, d = daemon
    p = spawn(
        "misdirected",
        [
            "engine",
            "--model",
            str(tiny_model_dir),
            "--connect",
            trainer,
            "--engine-id",
            "e9",
            "--threads",
            "1",
        ],
        d / "logs",
    )
    try:
        rc = p.popen.wait(90)  # it used to log "not accepted here" once a second, forever
    finally:
        p.stop()
    log = p.log_path.read_text(errors="replace")
    assert rc == 3, log[-3000:]
    want = (
        f"engine refused by the orchestrator: {trainer} is the daemon's trainer socket; engines "
        f"(`weightsync engine`) connect to its engine socket (--connect {engine})"
    )
    assert want in log, log[-3000:]
    assert log.count("WRONG_SOCKET") <= 2, log[-3000:]  # refused once, not once a second


def test_status_and_push_at_the_engine_socket_exit_2_at_once_naming_the_trainer_socket(
    daemon, tmp_path, tiny_state
):
    trainer, engine, _ = daemon
    want = (
        f"{engine} is the daemon's engine socket; trainers (`weightsync push`, `status`, "
        f"TrainerClient) connect to its trainer socket (--addr {trainer})"
    )
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(dict(perturbed(tiny_state, 1)), str(ckpt / "model.safetensors"))
    for args in (["status"], ["push", str(ckpt), "--version", "1", "--timeout", "120"]):
        t0 = time.monotonic()
        r = ws(*args, "--addr", engine, timeout=60)
        assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert line == f"{args[0]} failed: WRONG_SOCKET: {want}", line
        assert time.monotonic() - t0 < 30  # no resends, no settle: one answer
    r = ws("status", "--addr", engine, "--json", timeout=60)
    err = json.loads(r.stdout)
    assert r.returncode == 2 and err["code"] == "WRONG_SOCKET" and err["message"] == want, err
    assert err["details"]["socket"] == "engine" and err["details"]["type"] == "status", err
    with TrainerClient(engine, timeout=30.0) as c:  # the library raises the same, typed, at once
        t0 = time.monotonic()
        with pytest.raises(PeerError) as ei:
            c.status()
        assert time.monotonic() - t0 < 5
    assert ei.value.code is ErrorCode.WRONG_SOCKET and ei.value.message == want
    assert ei.value.state is None and ei.value.version is None  # it says nothing of a sync
