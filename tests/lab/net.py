"""A lab of hosts on this machine: each host a network namespace with one NIC into a
bridge that lives in a namespace of its own, each link shaped both ways to a rate.

Theory of operation: `Lab()` makes the bridge's namespace; `lab.host(name)` makes a host:
a namespace, a veth pair (the host's `eth0`, the bridge's port `pN`), an address on the
lab's /24, and a tbf shaper on both ends (the host's egress, and the port's egress toward
the host), so a host's link carries `rate_mbit` each way. A process runs on a host by
`ip netns exec` under a UTS namespace of its own (`Host.popen`): it sees only that
host's interfaces and its own hostname (weightsync tells hosts apart by hostname).
`Host.cut()` sets the bridge's port down: every packet both ways is dropped, with no FIN
and no RST (this kernel has no netem: delay and loss cannot be emulated, a cut can);
`heal()` sets it up again; `rate()` re-shapes both ways.

Rules:
- Every namespace is named `wslab-PID-RUN-NAME` (PID: the process that made it). A lab
  always tears down what it made (`close`, also on an exception in its `with` block):
  its processes (their process groups, SIGTERM then SIGKILL), then whatever else still
  runs in its namespaces, then the namespaces. A lab whose maker was SIGKILLed is removed
  by the next `Lab()` on this machine (`sweep_stale`): namespaces whose PID is gone.
- Addresses are those of the lab's own namespaces only (10.77.0.0/24 inside each lab;
  labs never share a bridge, so two labs at once do not meet).
- Where namespaces cannot be made (not root, no `ip`/`tc`/`unshare`), `unavailable()` says
  why and the tests skip with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from messages.segments import pid_alive
from orchestrator.daemon.config import child_env

PREFIX = "wslab"
SUBNET = "10.77.0"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-([a-z0-9-]+)$")
TOOLS = ("ip", "tc", "unshare")


class LabError(RuntimeError):
    """A lab command failed (its command line and output are in the message)."""


def _cmd(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise LabError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def _ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    return _cmd(["ip", *(["-n", ns] if ns else []), *args], check=check)


def namespaces() -> list[str]:
    """Every network namespace on this machine, by name."""
    return [line.split()[0] for line in _cmd(["ip", "netns", "list"]).splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    return [int(p) for p in _cmd(["ip", "netns", "pids", ns], check=False).split()]


def _remove(ns: str) -> None:
    """Kill what still runs in `ns`, then delete it."""
    for _ in range(50):
        pids = _pids_in(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _cmd(["ip", "netns", "del", ns], check=False)


def sweep_stale() -> list[str]:
    """Remove the namespaces of labs whose maker is gone (a SIGKILLed test)."""
    gone = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and not pid_alive(int(m.group(1))):
            _remove(ns)
            gone.append(ns)
    return gone


def unavailable() -> str | None:
    """Why this process cannot make a lab, or None when it can."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, veth, tc)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"the lab needs {', '.join(missing)}"
    probe = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}-probe"
    try:
        _cmd(["ip", "netns", "add", probe])
    except (LabError, OSError) as exc:
        return f"network namespaces cannot be made here: {exc}"
    _remove(probe)
    return None


def _shape(dev: str, ns: str, mbit: float) -> None:
    """tbf on `dev`'s egress: `mbit` Mbit/s, a 10 ms burst (at least 64 KiB: a GSO
    packet is segmented to fit), 50 ms of queue."""
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))
    _ip_tc = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf"]
    _cmd([*_ip_tc, "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"])


@dataclass
class Host:
    """One host of a lab: its namespace, address and link."""

    lab: Lab
    name: str
    ns: str
    addr: str
    port: str  # its link's port on the bridge (in the bridge's namespace)
    rate_mbit: float
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def hostname(self) -> str:
        return f"{self.name}-{self.lab.run_id}"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host: its network namespace, its own hostname."""
        return [
            "ip",
            "netns",
            "exec",
            self.ns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname,
            *argv,
        ]

    def popen(
        self,
        argv: Sequence[str],
        log: Path | None = None,
        env: dict[str, str] | None = None,
        stdin: int | IO[bytes] | None = subprocess.DEVNULL,
        stdout: int | IO[bytes] | None = None,
        cwd: Path | None = None,
        errlog: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on this host in a process group of its own (output to `log`, or
        `stdout`, and then its stderr to `errlog`; in `cwd`, else this process's
        directory); the lab stops it at close."""
        fh = open(log, "ab") if log is not None else None
        eh = open(errlog, "ab") if errlog is not None and fh is None else None
        try:
            p = subprocess.Popen(
                self.argv(argv),
                stdin=stdin,
                stdout=fh if fh is not None else stdout,
                stderr=subprocess.STDOUT if fh is not None else eh,
                env=child_env(env),
                start_new_session=True,
                cwd=cwd,
            )
        finally:
            for h in (fh, eh):
                if h is not None:
                    h.close()
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to its end; its output captured."""
        return subprocess.run(
            self.argv(argv), capture_output=True, text=True, timeout=timeout, env=child_env()
        )

    def cut(self) -> None:
        """The link goes dark both ways (the bridge's port down): no FIN, no RST."""
        _ip("link", "set", self.port, "down", ns=self.lab.bridge_ns)

    def heal(self) -> None:
        _ip("link", "set", self.port, "up", ns=self.lab.bridge_ns)

    def rate(self, mbit: float) -> None:
        """Re-shape the link, both ways."""
        _shape("eth0", self.ns, mbit)
        _shape(self.port, self.lab.bridge_ns, mbit)
        self.rate_mbit = mbit

    def listening(self) -> list[str]:
        """Every TCP address a process on this host listens on (from its /proc/net tables)."""
        out = []
        for table in ("tcp", "tcp6"):
            text = _cmd(["ip", "netns", "exec", self.ns, "cat", f"/proc/net/{table}"])
            for line in text.splitlines()[1:]:
                cols = line.split()
                if len(cols) > 3 and cols[3] == "0A":  # LISTEN
                    out.append(_addr(cols[1], table == "tcp6"))
        return sorted(out)


def _addr(hexaddr: str, v6: bool) -> str:
    host, port = hexaddr.split(":")
    if not v6:
        ip = ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))
        return f"{ip}:{int(port, 16)}"
    return f"[{host}]:{int(port, 16)}"


class Lab:
    """N hosts on one shaped bridge; a context manager that always tears them down."""

    def __init__(self, rate_mbit: float = 200.0) -> None:
        why = unavailable()
        if why is not None:
            raise LabError(why)
        sweep_stale()
        self.rate_mbit = rate_mbit
        self.run_id = uuid.uuid4().hex[:6]
        self.prefix = f"{PREFIX}-{os.getpid()}-{self.run_id}"
        self.bridge_ns = f"{self.prefix}-bridge"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        try:
            _cmd(["ip", "netns", "add", self.bridge_ns])
            self._made.append(self.bridge_ns)
            _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
            _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        except BaseException:
            self.close()
            raise

    def host(self, name: str, rate_mbit: float | None = None) -> Host:
        """A new host on the bridge, its link shaped to `rate_mbit` (the lab's default)."""
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,15}", name) or name in self.hosts or name == "bridge":
            raise LabError(f"host name {name!r}: lowercase, unique, not 'bridge'")
        index = len(self.hosts) + 1
        if index > 250:
            raise LabError("a lab has at most 250 hosts")
        ns, port = f"{self.prefix}-{name}", f"p{index}"
        _cmd(["ip", "netns", "add", ns])
        self._made.append(ns)
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=self.bridge_ns)
        _ip("link", "set", port, "master", "br0", ns=self.bridge_ns)
        _ip("link", "set", port, "up", ns=self.bridge_ns)
        addr = f"{SUBNET}.{index}"
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        h = Host(self, name, ns, addr, port, rate_mbit or self.rate_mbit)
        h.rate(h.rate_mbit)
        self.hosts[name] = h
        return h

    def close(self) -> None:
        procs = [p for h in self.hosts.values() for p in h.procs]
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10.0
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        for ns in reversed(self._made):
            _remove(ns)
        self._made.clear()

    def mine(self) -> list[str]:
        """The namespaces of this lab that exist now."""
        return [ns for ns in namespaces() if ns.startswith(self.prefix + "-")]

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
