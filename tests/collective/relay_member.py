"""One member of a test group (`test_relay.py`): joins over a torch TCPStore, takes part
in the broadcasts its arguments list, and prints one JSON line per broadcast.

    python -m tests.collective.relay_member RANK WORLD PORT SIZES [--die-after K] [--timeout S]

Rank 0 broadcasts bytes made from each broadcast's index; the others check what arrived.
`--die-after K`: this member SIGKILLs itself after its K-th broadcast.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from messages.distgroup import Group, GroupError, GroupSpec


def pattern(i: int, size: int) -> torch.Tensor:
    return ((torch.arange(size, dtype=torch.int64) * (i + 3) + i) % 251).to(torch.uint8)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("port", type=int)
    ap.add_argument("sizes")
    ap.add_argument("--die-after", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()
    store = dist.TCPStore(
        "127.0.0.1", a.port, a.world, a.rank == 0, timeout=datetime.timedelta(seconds=a.timeout)
    )
    spec = GroupSpec("relaytest", "127.0.0.1", a.port, a.rank, a.world, "gloo", a.timeout, bind="127.0.0.1")
    g = Group(spec, store=store)
    for i, size in enumerate(int(x) for x in a.sizes.split(",")):
        buf = pattern(i, size) if a.rank == 0 else torch.zeros(size, dtype=torch.uint8)
        t0 = time.monotonic()
        try:
            g.broadcast(buf)
        except GroupError as exc:
            out = {"i": i, "error": str(exc), "code": exc.code.value, "seconds": time.monotonic() - t0}
            print(json.dumps(out), flush=True)
            return 3
        ok = bool(torch.equal(buf, pattern(i, size)))
        print(json.dumps({"i": i, "ok": ok, "size": size}), flush=True)
        if i + 1 == a.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
    g.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
