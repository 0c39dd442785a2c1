"""`python -m bench.status_latency`: how fast the daemon answers `status` while a large
push with `--spool` runs (spool writes and the commit's fsync are on the storage thread,
so the event loop must stay responsive).

A daemon with a spool and one sink engine; a trainer process pushes a model of
`--model-bytes` (512 MiB by default), while this process asks `status` every `--every`
seconds and records each round trip (the trainer is a process of its own, so its
packing and hashing do not hold this process's GIL and inflate the measurement). Baseline: the same
status requests against the idle daemon, measured in the same run. Prints p50, p99 and
max for both; with `--check`, exits 1 when the p99 under load passes `--target-ms` (50).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import MiB, parse_size

TRAINER = r"""
import json, sys
from engines.sink import random_weights, read_spec
from orchestrator.trainer.client import TrainerClient
addr, model, bucket, transport = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
weights = list(random_weights(read_spec(model), seed=1))
with TrainerClient(addr, timeout=120.0) as c:
    r = c.push(weights, 1, bucket_bytes=bucket, transport=transport)
print(json.dumps({"seconds": r.seconds, "state": r.state}))
"""


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _probe(client, seconds: float, every: float, stop: threading.Event | None = None) -> list[float]:
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        t0 = time.perf_counter()
        client.status()
        out.append((time.perf_counter() - t0) * 1000)
        time.sleep(every)
    return out


def run(model_bytes: int, bucket_bytes: int, every: float, transport: str) -> dict:
    from engines.sink import synthetic_spec, write_spec
    from examples.launch import Cluster

    spec = synthetic_spec(model_bytes, tensor_bytes=16 * MiB)
    with tempfile.TemporaryDirectory(prefix="weightsync-status-") as tmp:
        work = Path(tmp)
        model = write_spec(work / "sink", spec)
        c = Cluster(
            work / "d",
            model,
            engines=1,
            backend="sink",
            daemon_args=["--spool", str(work / "spool"), "--log-level", "warning"],
        )
        with c:
            with c.client(timeout=10.0) as probe:
                idle = _probe(probe, 2.0, every)
                trainer = subprocess.Popen(
                    [sys.executable, "-c", TRAINER, c.addr, str(model), str(bucket_bytes), transport],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                stop = threading.Event()
                threading.Thread(target=lambda: (trainer.wait(), stop.set()), daemon=True).start()
                loaded = _probe(probe, 600.0, every, stop)
                result = json.loads(trainer.stdout.read() or "{}")
                spool = c.status()["spool"]

    def summary(xs: list[float]) -> dict:
        return {
            "n": len(xs),
            "p50_ms": round(statistics.median(xs), 2),
            "p99_ms": round(_percentile(xs, 0.99), 2),
            "max_ms": round(max(xs), 2),
        }

    return {
        "model_bytes": model_bytes,
        "bucket_bytes": bucket_bytes,
        "transport": transport,
        "push": result,
        "spool": spool,
        "idle": summary(idle),
        "during_push": summary(loaded),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.status_latency", description=__doc__.split("\n")[0])
    ap.add_argument("--model-bytes", default="512MiB")
    ap.add_argument("--bucket-bytes", default="16MiB")
    ap.add_argument("--every", type=float, default=0.01)
    ap.add_argument("--transport", default="inline")
    ap.add_argument("--target-ms", type=float, default=50.0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    r = run(parse_size(args.model_bytes), parse_size(args.bucket_bytes), args.every, args.transport)
    i, d = r["idle"], r["during_push"]
    print(
        f"status round trip, idle daemon:        n={i['n']} p50 {i['p50_ms']} ms, p99 {i['p99_ms']} ms, max {i['max_ms']} ms"
    )
    print(
        f"status round trip, during {args.model_bytes} push with --spool ({r['push'].get('seconds', 0):.2f} s, "
        f"{r['push'].get('state')}): n={d['n']} p50 {d['p50_ms']} ms, p99 {d['p99_ms']} ms, max {d['max_ms']} ms "
        f"(p99 / idle p99 = {d['p99_ms'] / max(i['p99_ms'], 1e-3):.1f}x)"
    )
    print(
        f"spool after the push: {r['spool']['state']}, version {r['spool']['version']}, {r['spool']['bytes']} bytes"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    if args.check and d["p99_ms"] > args.target_ms:
        print(f"MISSED: status p99 {d['p99_ms']} ms during the push > target {args.target_ms} ms")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
