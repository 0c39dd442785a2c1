"""docs/INTEGRATIONS.md's TRL run, as the page writes it: its four commands (daemon, vLLM
server, the engine feeding it, `examples/trl_grpo.py`) are read from the page's bash block
and run as subprocesses, each started once the page says it may be.

Replaced, and only these: `/models/policy` by a tiny random Llama (saved here), the ports
5555, 5556 and 8000 by free ones (5556's + 1, the fan-out, free too), `weightsync` by
`python -m orchestrator` and `python` by this interpreter (the same programs: the
`weightsync` entry point is `orchestrator.cli.main:main`). Every command runs in a fresh
directory (the daemon's journal, the trainer's output and `--result` land there) with the
repository on PYTHONPATH, which is what running `-m examples.trl_grpo` from its root gives."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from examples.tiny import build_tiny_llama
from messages.errors import WeightSyncError
from orchestrator.daemon.config import child_env
from orchestrator.trainer.client import TrainerClient
from tests.doc_commands import commands, section, substitute

pytest.importorskip("trl", reason="the .[trl] extra (make test installs it)")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3  # the example's default: the page's command does not set --steps


def _free_ports() -> tuple[int, int, int]:
    """Trainer port, engine port (its + 1 free as well: the fan-out), server port."""
    while True:
        with socket.socket() as a, socket.socket() as b, socket.socket() as c, socket.socket() as d:
            a.bind(("127.0.0.1", 0))
            b.bind(("127.0.0.1", 0))
            port = b.getsockname()[1]
            try:
                c.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            d.bind(("127.0.0.1", 0))
            return a.getsockname()[1], port, d.getsockname()[1]


def _program(argv: list[str]) -> list[str]:
    if argv[0] == "weightsync":
        return [sys.executable, "-m", "orchestrator", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    raise AssertionError(f"a command the test does not know how to run: {argv}")


@contextmanager
def _started(argv: list[str], cwd: Path, log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            _program(argv), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _wait(what: str, ready, procs: dict[str, subprocess.Popen[bytes]], logs: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited {p.returncode}:\n{(logs / name).read_text()[-4000:]}")
        if ready():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout}s")


def test_the_trl_section_runs_as_written(tmp_path):
    t0 = time.monotonic()
    model = build_tiny_llama(tmp_path / "policy", size="tiny", seed=0)
    trainer_port, engine_port, server_port = _free_ports()
    values = {"/models/policy": str(model), "5555": str(trainer_port)}
    values |= {"5556": str(engine_port), "8000": str(server_port)}
    serve, server, engine, trainer = (
        substitute(c, values) for c in commands(section("INTEGRATIONS.md", "TRL"))
    )
    run = tmp_path / "run"
    run.mkdir()
    env = child_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    addr = f"tcp://127.0.0.1:{trainer_port}"
    url = f"http://127.0.0.1:{server_port}"

    def server_up() -> bool:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).close()
            return True
        except OSError:
            return False

    def engine_listed() -> bool:
        try:
            with TrainerClient(addr, timeout=2.0, retries=0) as c:
                return any(
                    e["engine_id"] == "server-0" and e["state"] != "LOST" for e in c.status()["engines"]
                )
        except WeightSyncError:
            return False

    with ExitStack() as stack:
        procs: dict[str, subprocess.Popen[bytes]] = {}
        # 1 and 2 together (the page's terminals); 3 once the server answers; 4 once listed
        for name, argv in (("serve", serve), ("vllm-server", server)):
            procs[name] = stack.enter_context(_started(argv, run, run / name, env))
        _wait("the vLLM server answering /v1/models", server_up, procs, run, 240)
        procs["engine"] = stack.enter_context(_started(engine, run, run / "engine", env))
        _wait("server-0 in weightsync status", engine_listed, procs, run, 60)
        with open(run / "trainer", "wb") as fh:
            r = subprocess.run(
                _program(trainer),
                cwd=run,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=300,
                check=False,
            )
        text = (run / "trainer").read_text(errors="replace")
        assert r.returncode == 0, text[-6000:]
        for name, p in procs.items():  # all still up: nothing the trainer did ended one
            assert p.poll() is None, (name, (run / name).read_text()[-3000:])
    print(f"the page's four commands: {time.monotonic() - t0:.1f}s in all")

    out = json.loads((run / "trl-grpo.json").read_text())  # the page's --result, in the run directory
    syncs = out["syncs"]
    assert out["global_step"] == STEPS and len(syncs) == STEPS + 1
    assert [s["version"] for s in syncs] == list(range(1, STEPS + 2))
    for s in syncs:
        assert s["state"] == "READY", s
        assert s["engine_digests"] == {"server-0": s["sent_digest"]}, s
        assert s["label_after"] == [str(s["version"])], s  # the token-in-token-out label
    assert out["trl_model_version"] == STEPS + 1
    # the line the page says the trainer prints per sync
    lines = [ln for ln in text.splitlines() if "weightsync sync: version=" in ln]
    assert len(lines) == STEPS + 1, text[-3000:]
