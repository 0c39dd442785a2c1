"""The relayed broadcast (messages/relay.py) in real processes over gloo on loopback:
what every member receives, and what a member's death does to the others."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from messages.relay import RELAY_CHUNK_MAX, RELAY_CHUNK_MIN, chunk_elems, relays

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(world: int, sizes: list[int], die: dict[int, int] | None = None, timeout: float = 60.0):
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.collective.relay_member", str(r), str(world), str(port)]
            + [",".join(map(str, sizes)), "--timeout", str(timeout)]
            + (["--die-after", str(die[r])] if die and r in die else []),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = {}
    for r, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=timeout + 60)
        out[r] = (p.returncode, [json.loads(x) for x in stdout.splitlines() if x.startswith("{")], stderr)
    return out


def test_who_relays():
    assert relays("gloo", 3) and relays("gloo", 9)
    assert not relays("gloo", 2) and not relays("nccl", 5)


def test_chunks_are_bounded_and_cover_the_tensor():
    assert chunk_elems(10, 1) == RELAY_CHUNK_MIN  # one chunk for a small tensor
    assert chunk_elems(1 << 30, 1) == RELAY_CHUNK_MAX
    assert chunk_elems(1 << 22, 4) * 4 == (1 << 22) * 4 // 16  # a sixteenth, in float32 elements


def test_every_member_receives_every_broadcast_in_order():
    """Five members (a trainer and four engines): broadcasts of sizes below a chunk, not a
    multiple of one, many chunks, and empty, one after the other in the same group."""
    sizes = [1, 100_003, 5 << 20, 0, 3 * RELAY_CHUNK_MAX + 7]
    out = _run(5, sizes)
    for r, (rc, lines, err) in out.items():
        assert rc == 0, (r, err[-2000:])
        assert [x["i"] for x in lines] == list(range(len(sizes))), (r, lines)
        assert all(x["ok"] for x in lines), (r, lines)


def test_a_member_that_dies_fails_the_others_at_once_not_at_the_deadline():
    """Member 2 of 5 is SIGKILLed after the first broadcast: in the second, the members
    before it (their sends) and after it (their receives) fail as engine failures, well
    before the group's 60 s deadline."""
    out = _run(5, [4 << 20, 4 << 20, 4 << 20], die={2: 1}, timeout=60.0)
    assert out[2][0] == -9
    for r in (0, 1, 3, 4):
        rc, lines, err = out[r]
        assert lines[0].get("ok") is True, (r, lines, err[-1000:])
        failed = [x for x in lines if "error" in x]
        assert rc == 3 and failed, (r, lines, err[-1000:])
        assert failed[0]["code"] == "ENGINE_FAILED" and failed[0]["seconds"] < 30, (r, failed)
