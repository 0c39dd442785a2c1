"""A weightsync fleet on a lab: the daemon, the trainer and each engine on a host of its
own, every byte between them over the lab's shaped links.

The daemon listens on its host's address only (`--bind`, `--engine-bind`), the engines
connect to it there and offer their own address for a group's sockets, and the trainer is
`tests.lab.agent` on its host, driven by `LabFleet.ask`. Logs go to the fleet's workdir.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from examples.launch import engine_args, serve_args
from tests.lab.net import Host, Lab

TRAINER_PORT, ENGINE_PORT = 5555, 5556
ORCHESTRATOR = (sys.executable, "-m", "orchestrator")


@dataclass
class LabFleet:
    lab: Lab
    workdir: Path
    model_dir: Path
    engines: int = 2
    min_engines: int | None = None
    daemon_args: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    backend: str = "torch"
    sources: int = 1  # trainer hosts, each one source of a sharded push (`push_sharded`)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.daemon_host = self.lab.host("daemon")
        self.trainer_host = self.lab.host("trainer")
        # the other sources' hosts (source 0 is the trainer), each with an agent of its own
        self.source_hosts = [self.lab.host(f"s{k}") for k in range(1, self.sources)]
        self.source_agents: list[subprocess.Popen[bytes]] = []
        self.engine_hosts = [self.lab.host(f"e{i}") for i in range(self.engines)]
        self.addr = f"tcp://{self.daemon_host.addr}:{TRAINER_PORT}"
        self.engine_addr = f"tcp://{self.daemon_host.addr}:{ENGINE_PORT}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.agent: subprocess.Popen[bytes] | None = None
        self._next = 0
        self._answers: dict[Any, dict[str, Any]] = {}

    # -- processes ----------------------------------------------------------------------
    def start_daemon(self) -> None:
        n = self.engines if self.min_engines is None else self.min_engines
        self.procs["daemon"] = self.daemon_host.popen(
            [
                *ORCHESTRATOR,
                *serve_args(
                    self.addr, self.engine_addr, self.workdir / "state.db", n, "--log-json", *self.daemon_args
                ),
            ],
            log=self.log("daemon"),
        )

    def start_engine(self, i: int) -> None:
        h = self.engine_hosts[i]
        self.procs[f"e{i}"] = h.popen(
            [
                *ORCHESTRATOR,
                *engine_args(
                    self.backend,
                    self.model_dir,
                    self.engine_addr,
                    f"e{i}",
                    "--collective-host",
                    h.addr,
                    "--log-json",
                    *self.engine_args,
                ),
            ],
            log=self.log(f"e{i}"),
        )

    def start_agent(self) -> None:
        self.agent = self.trainer_host.popen(
            [sys.executable, "-m", "tests.lab.agent", str(self.model_dir), self.addr, self.trainer_host.addr],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            errlog=self.log("agent"),  # its library's log, and its threads' stacks when it hangs
        )
        ready = self._read(120.0)
        if not ready.get("ready"):
            raise RuntimeError(f"the trainer agent did not start: {ready}")
        for h in self.source_hosts:
            a = h.popen(
                [sys.executable, "-m", "tests.lab.agent", str(self.model_dir), self.addr, h.addr],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            self.source_agents.append(a)
            got = _read_line(a, 120.0)
            if not got.get("ready"):
                raise RuntimeError(f"source agent on {h.name} did not start: {got}")

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def __enter__(self) -> LabFleet:
        try:
            self.start_daemon()
            for i in range(self.engines):
                self.start_engine(i)
            self.start_agent()
            self.wait_engines(self.engines)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for a in [self.agent, *self.source_agents]:
            if a is not None and a.poll() is None and a.stdin is not None:
                try:
                    a.stdin.write(b'{"op": "quit"}\n')
                    a.stdin.flush()
                except OSError:
                    pass
        # the lab stops every process it started (SIGTERM, then SIGKILL)

    # -- the trainer --------------------------------------------------------------------
    def send(self, req: dict[str, Any]) -> int:
        """Start one request on the trainer's host; its id (`answer` waits for it)."""
        if self.agent is None or self.agent.stdin is None:
            raise RuntimeError("no trainer agent")
        self._next += 1
        self.agent.stdin.write((json.dumps({**req, "id": self._next}) + "\n").encode())
        self.agent.stdin.flush()
        return self._next

    def answer(self, rid: int, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while rid not in self._answers:
            got = self._read(max(0.0, deadline - time.monotonic()))
            self._answers[got.get("id")] = got
        return self._answers.pop(rid)

    def ask(self, req: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """One request to the trainer on its host; its answer."""
        return self.answer(self.send(req), timeout)

    def _read(self, timeout: float) -> dict[str, Any]:
        if self.agent is None:
            raise RuntimeError("no trainer agent")
        try:
            return _read_line(self.agent, timeout)
        except TimeoutError as exc:  # what the trainer was doing: its threads' stacks, its log
            if self.agent.poll() is None:
                self.agent.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
            tail = self.log("agent").read_text(errors="replace")[-6000:] if self.log("agent").exists() else ""
            raise TimeoutError(f"{exc}\n----- agent log (tail) -----\n{tail}") from None

    def push_sharded(self, version: int, timeout: float = 120.0, **kw: Any) -> list[dict[str, Any]]:
        """One sharded push of `version`: every source (the trainer and each source host)
        pushes its part at once; each source's answer, in source order."""
        n = self.sources
        first = self.send({"op": "push", "version": version, "timeout": timeout, "source": [0, n], **kw})
        for k, a in enumerate(self.source_agents, start=1):
            if a.stdin is None:
                raise RuntimeError("no source agent")
            req = {"op": "push", "version": version, "timeout": timeout, "source": [k, n], "id": 1, **kw}
            a.stdin.write((json.dumps(req) + "\n").encode())
            a.stdin.flush()
        answers = [self.answer(first, timeout + 60.0)]
        answers += [_read_line(a, timeout + 60.0) for a in self.source_agents]
        return answers

    def push(self, version: int, timeout: float = 120.0, **kw: Any) -> dict[str, Any]:
        return self.ask({"op": "push", "version": version, "timeout": timeout, **kw}, timeout=timeout + 60.0)

    def status(self) -> dict[str, Any]:
        got = self.ask({"op": "status"}, timeout=60.0)
        if not got["ok"]:
            raise RuntimeError(f"status: {got}")
        result: dict[str, Any] = got["result"]
        return result

    def wait_engines(self, n: int, timeout: float = 120.0) -> dict[str, Any]:
        """Until `n` engines are registered and live."""
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                st = self.status()
            except RuntimeError:
                time.sleep(0.2)
                continue
            live = [e for e in _engines(st) if e.get("state") != "LOST"]
            if len(live) >= n:
                return st
            time.sleep(0.2)
        raise TimeoutError(f"{n} engines not registered within {timeout}s: {st}")

    def check_alive(self) -> None:
        """Raise, with its log's tail, if a process of the fleet has exited."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = self.log(name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited {p.returncode}:\n{tail}")

    def host_of(self, engine: int) -> Host:
        return self.engine_hosts[engine]


def _read_line(agent: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """An agent's next answer (one JSON line on its stdout)."""
    if agent.stdout is None:
        raise RuntimeError("an agent without a stdout")
    ready, _, _ = select.select([agent.stdout], [], [], timeout)
    line = agent.stdout.readline() if ready else b""
    if not line:
        raise TimeoutError(f"a trainer agent did not answer within {timeout}s (exit {agent.poll()})")
    got: dict[str, Any] = json.loads(line)
    return got


def _engines(st: dict[str, Any]) -> list[dict[str, Any]]:
    engines = st.get("engines") or []
    if isinstance(engines, dict):
        return [{"engine_id": k, **v} for k, v in engines.items()]
    out: list[dict[str, Any]] = list(engines)
    return out
