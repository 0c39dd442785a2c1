"""Start and stop a local daemon and engine processes (demo, tests, smoke checks).

Rules: every process is a real `python -m orchestrator ...` subprocess in its own
process group with its logs in a file; `Cluster` is a context manager that always
terminates what it started (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from messages.errors import WeightSyncError
from messages.keys import client_keys
from orchestrator.daemon.config import child_env
from orchestrator.trainer.client import TrainerClient


class LaunchError(RuntimeError):
    """A process did not come up (exit code 3 in the CLI)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> int | None:
        self.terminate()
        return self.wait_stopped(grace)

    def terminate(self) -> None:
        """SIGTERM if still running; `wait_stopped` waits for the exit."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def wait_stopped(self, grace: float = 10.0) -> int | None:
        """Wait up to `grace` s for the exit, then SIGKILL the process group."""
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
        return self.popen.returncode


def serve_args(addr: str, engine_addr: str, state_db: Path, min_engines: int, *extra: str) -> list[str]:
    """`weightsync serve`'s arguments for a daemon on these addresses (tests, the lab)."""
    return [
        "serve",
        "--bind",
        addr,
        "--engine-bind",
        engine_addr,
        "--state-db",
        str(state_db),
        "--min-engines",
        str(min_engines),
        *extra,
    ]


def engine_args(backend: str, model_dir: Path, connect: str, engine_id: str, *extra: str) -> list[str]:
    """`weightsync engine`'s arguments for an engine of `model_dir` on the daemon at `connect`."""
    return [
        "engine",
        "--backend",
        backend,
        "--model",
        str(model_dir),
        "--connect",
        connect,
        "--engine-id",
        engine_id,
        *extra,
    ]


def spawn(name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    fh = open(log_path, "ab")
    popen = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        stdout=fh,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env({"PYTHONUNBUFFERED": "1", **(env or {})}),
        start_new_session=True,
    )
    fh.close()
    return Proc(name, popen, log_path)


@dataclass
class Cluster:
    """A daemon plus engines on this machine, addressed over ipc:// in `workdir`."""

    workdir: Path
    model_dir: Path | None = None
    engines: int = 2
    backend: str = "torch"
    min_engines: int | None = None
    daemon_args: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    keys: Path | None = None  # CURVE keys directory (daemon, engines and clients use it)
    digest_files: bool = False  # engines answer `fresh_digests` (`weightsync engine --digest-file`)
    procs: list[Proc] = field(default_factory=list)
    started: set[int] = field(default_factory=set)  # every pid this cluster spawned, restarts too

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.addr = f"ipc://{self.workdir}/trainer.sock"
        self.engine_addr = f"ipc://{self.workdir}/engine.sock"
        self.state_db = self.workdir / "state.db"
        self.log_dir = self.workdir / "logs"

    @property
    def daemon(self) -> Proc:
        return self.procs[0]

    def start_daemon(self) -> Proc:
        min_engines = self.engines if self.min_engines is None else self.min_engines
        p = spawn(
            "daemon",
            serve_args(
                self.addr,
                self.engine_addr,
                self.state_db,
                min_engines,
                *(["--keys", str(self.keys)] if self.keys else []),
                *self.daemon_args,
            ),
            self.log_dir,
            self.env,
        )
        self.started.add(p.popen.pid)
        if self.procs and self.procs[0].name == "daemon":
            self.procs[0] = p  # a restart replaces the old daemon
        else:
            self.procs.insert(0, p)
        return p

    def start_engine(self, engine_id: str, extra: list[str] | None = None) -> Proc:
        if self.model_dir is None:
            raise LaunchError("no model directory for the engines")
        p = spawn(
            engine_id,
            engine_args(
                self.backend,
                self.model_dir,
                self.engine_addr,
                engine_id,
                *(["--keys", str(self.keys)] if self.keys else []),
                *(["--digest-file", str(self.digest_file(engine_id))] if self.digest_files else []),
                *self.engine_args,
                *(extra or []),
            ),
            self.log_dir,
            self.env,
        )
        self.started.add(p.popen.pid)
        # a restart under the same id replaces the dead process
        self.procs = [q for q in self.procs if q.name != engine_id or q.popen.poll() is None]
        self.procs.append(p)
        return p

    def digest_file(self, engine_id: str) -> Path:
        return self.workdir / f"{engine_id}.digest.json"

    def fresh_digests(self, engine_ids: list[str], timeout: float = 10.0) -> dict[str, dict[str, Any]]:
        """Ask each engine process for the digest of the weights it holds now (SIGUSR1: it
        reads them back from their storage) and return its answers: {engine_id: {asked,
        version, reported_digest, digest, error, ...}}. An engine that is not running or
        does not answer within `timeout` is left out."""
        if not self.digest_files:
            raise LaunchError("fresh_digests needs Cluster(digest_files=True)")
        asked: dict[str, tuple[int, int]] = {}  # engine_id -> (its pid, answers it had given)
        for p in self.procs:
            if p.name in engine_ids and p.popen.poll() is None:
                a = self._answer(p.name)
                asked[p.name] = (p.popen.pid, a.get("asked", 0) if a.get("pid") == p.popen.pid else 0)
                p.popen.send_signal(signal.SIGUSR1)
        out: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(asked) and time.monotonic() < deadline:
            for name, (pid, before) in asked.items():
                a = self._answer(name)
                if name not in out and a.get("pid") == pid and a.get("asked", 0) > before:
                    out[name] = a
            time.sleep(0.02)
        return out

    def _answer(self, engine_id: str) -> dict[str, Any]:
        try:
            got: dict[str, Any] = json.loads(self.digest_file(engine_id).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return got

    def __enter__(self) -> Cluster:
        try:
            self.start_daemon()
            for i in range(self.engines):
                self.start_engine(f"engine-{i}")
            self.wait_engines(self.engines, timeout=120.0 if self.backend == "torch" else 600.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def client(self, **kw: Any) -> TrainerClient:
        if self.keys is not None and "keys" not in kw:
            kw["keys"] = client_keys(self.keys, "trainer")
        return TrainerClient(self.addr, **kw)

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        with self.client(timeout=timeout, retries=0) as c:
            return c.status()

    def wait_engines(self, n: int, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until `n` engines are registered and not lost."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.popen.poll() is not None:
                    raise LaunchError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")
            try:
                last = self.status(timeout=2.0)
            except WeightSyncError:
                continue
            live = [e for e in last.get("engines", []) if e["state"] != "LOST"]
            if len(live) >= n:
                return last
            time.sleep(0.2)
        raise LaunchError(f"{n} engine(s) not registered within {timeout}s; last status: {last}")

    def stop(self) -> None:
        # Engines first, so the daemon does not spend its shutdown on lost engines. They are
        # told all at once, then waited for: an engine takes about a second to drain.
        engines = [p for p in reversed(self.procs) if p.name != "daemon"]
        for p in engines:
            p.terminate()
        for p in engines:
            p.wait_stopped()
        for p in self.procs:
            if p.name == "daemon":
                p.stop()
