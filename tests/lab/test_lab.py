"""The lab itself: hosts that reach each other only over their shaped links, a cut that
drops everything both ways without a FIN, a heal that resumes the same connection, and a
teardown that leaves nothing behind, also after its maker was SIGKILLed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.integration.helpers import wait_for
from tests.lab.net import Lab, namespaces, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

# A receiver on one host: accepts one connection, reads until EOF, prints a JSON line per
# event (listening, first byte, each MiB, the end) with its monotonic clock.
RECEIVER = textwrap.dedent(
    """
    import json, socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
    print(json.dumps({"ev": "listening"}), flush=True)
    c, _ = s.accept()
    n, t0, mark = 0, None, 1 << 20
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        if t0 is None:
            t0 = time.monotonic()
        n += len(b)
        while n >= mark:
            print(json.dumps({"ev": "bytes", "n": mark, "t": time.monotonic()}), flush=True)
            mark += 1 << 20
    print(json.dumps({"ev": "eof", "n": n, "t0": t0, "t": time.monotonic()}), flush=True)
    """
)
# A source: connects, sends N MiB, closes; reports each MiB it handed to the kernel.
SENDER = textwrap.dedent(
    """
    import json, socket, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    c.settimeout(None)
    chunk = b"x" * (1 << 20)
    for i in range(int(sys.argv[3])):
        c.sendall(chunk)
        print(json.dumps({"ev": "sent", "n": i + 1, "t": time.monotonic()}), flush=True)
    c.close()
    print(json.dumps({"ev": "closed"}), flush=True)
    """
)


class Lines:
    """A process's JSON lines, read as they come."""

    def __init__(self, p: subprocess.Popen[bytes]) -> None:
        self.p, self.seen = p, []

    def wait(self, ev: str, timeout: float = 60.0, **match: object) -> dict:
        def find() -> dict | None:
            for e in self.seen:
                if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
                    return e
            return None

        def more() -> dict | None:
            got = find()
            if got is None:
                line = self.p.stdout.readline()
                if line:
                    self.seen.append(json.loads(line))
                    got = find()
            return got

        return wait_for(more, timeout, f"{ev} {match}", every=0.0)


def _pair(lab: Lab, mib: int) -> tuple[Lines, Lines]:
    a, b = lab.host("a"), lab.host("b")
    rx = Lines(b.popen([sys.executable, "-c", RECEIVER, b.addr, "7000"], stdout=subprocess.PIPE))
    rx.wait("listening")
    tx = Lines(a.popen([sys.executable, "-c", SENDER, b.addr, "7000", str(mib)], stdout=subprocess.PIPE))
    return rx, tx


def test_a_link_carries_its_rate_and_no_more():
    """16 MiB over a 100 Mbit/s link: the receiver's rate is at most the link's (the
    shaper holds) and not far under it (a lab link is a link, not a trickle)."""
    with Lab(rate_mbit=100) as lab:
        rx, _ = _pair(lab, 16)
        end = rx.wait("eof")
        mbit = end["n"] * 8 / (end["t"] - end["t0"]) / 1e6
        assert end["n"] == 16 << 20
        assert 50 <= mbit <= 105, mbit
        print(f"16 MiB at {mbit:.1f} Mbit/s over a 100 Mbit/s link")


def test_hosts_see_only_their_own_link_and_hostname():
    with Lab() as lab:
        a, b = lab.host("a"), lab.host("b")
        out = a.run(["sh", "-c", "hostname; cat /proc/net/dev"]).stdout
        assert out.splitlines()[0] == a.hostname != b.hostname
        assert "eth0" in out and "br0" not in out
        assert a.run(["cat", "/proc/net/route"]).returncode == 0
        # the other host answers over the lab, the machine's own addresses are not there
        ok = a.run([sys.executable, "-c", f"import socket; socket.create_connection(('{b.addr}', 9), 2)"])
        assert "ConnectionRefused" in ok.stderr, ok.stderr  # b's kernel answered (RST): reachable


def test_a_cut_link_drops_everything_without_a_fin_and_a_heal_resumes_the_connection():
    """Mid-transfer the receiver's port goes down: the source stalls (nothing is acked),
    the receiver gets no EOF while it is down (no FIN, no RST); healed, the same
    connection carries the rest to the end."""
    with Lab(rate_mbit=200) as lab:
        rx, tx = _pair(lab, 24)
        rx.wait("bytes", n=4 << 20)
        lab.hosts["b"].cut()
        wait_for(lambda: _blocked_for(tx, 1.5), 60, "the source to stall on the cut link", every=0.1)
        _drain(rx)
        assert all(e["ev"] != "eof" for e in rx.seen), rx.seen
        assert all(e["ev"] != "closed" for e in tx.seen), tx.seen
        lab.hosts["b"].heal()
        end = rx.wait("eof", timeout=120)
        assert end["n"] == 24 << 20
        tx.wait("closed")


def _drain(lines: Lines) -> None:
    """Read what the process printed so far, without blocking."""
    while _readable(lines.p):
        line = lines.p.stdout.readline()
        if not line:
            break
        lines.seen.append(json.loads(line))


def _readable(p: subprocess.Popen[bytes]) -> bool:
    import select

    return bool(p.stdout and select.select([p.stdout], [], [], 0)[0])


def _blocked_for(tx: Lines, seconds: float) -> bool:
    """The source has reported nothing new for `seconds` of its own clock (read what it
    printed so far; a blocked sendall prints nothing)."""
    _drain(tx)
    last = max((e.get("t", 0.0) for e in tx.seen), default=0.0)
    return last > 0 and time.monotonic() - last >= seconds


def test_a_lab_leaves_nothing_behind_even_when_its_maker_is_killed(tmp_path):
    with Lab() as lab:
        lab.host("a")
        made = lab.mine()
        assert len(made) == 2, made  # the bridge and the host
    assert not [ns for ns in namespaces() if ns in made]
    # A maker SIGKILLed with its lab up (and a process running on a host): the next lab
    # removes both namespaces and what ran in them.
    script = textwrap.dedent(
        """
        import sys, time
        from tests.lab.net import Lab
        lab = Lab()
        h = lab.host("a")
        h.popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(lab.prefix, flush=True)
        time.sleep(600)
        """
    )
    maker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    prefix = maker.stdout.readline().strip()
    assert prefix and [ns for ns in namespaces() if ns.startswith(prefix + "-")]
    maker.send_signal(signal.SIGKILL)
    maker.wait(10)
    with Lab():
        pass
    assert not [ns for ns in namespaces() if ns.startswith(prefix + "-")]
