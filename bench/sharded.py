"""`python -m bench --sources 1,2,4`: wall time per sync of a sharded push, the same model
bytes sent by 1, 2 and 4 trainer processes (each a real process with its own connection,
`push(source=(k, n))` over the byte-balanced plan), into real sink-engine processes
through the real daemon, per transport.

Every point is one warm-up sync, then `--repeats` syncs; figures are medians with min/max,
and the ratio is against the 1-source sync of the same transport, measured in the same
run (the baseline). The JSON keeps every repeat and the machine. What the figures mean on
a host whose cores the sources share is in docs/BENCHMARKS.md ("Sharded push").

A source process: `python -m bench.sharded --worker SPEC_DIR ADDR K N`; it builds the
same seeded model as every other source, keeps its planned part, and answers each line
`push VERSION TRANSPORT BUCKET_BYTES WINDOW` on stdin with one JSON line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import MiB


def _worker(spec_dir: str, addr: str, k: int, n: int) -> None:
    import torch

    from engines.sink import random_weights, read_spec
    from messages.dtypes import dtype_name
    from orchestrator.trainer.client import TrainerClient
    from orchestrator.trainer.shard import plan_shards

    torch.set_num_threads(1)
    weights = list(random_weights(read_spec(spec_dir)))
    metas = [(m, tuple(t.shape), dtype_name(t.dtype), t.numel() * t.element_size()) for m, t in weights]
    plan = plan_shards(metas, n)
    mine = [(m, t) for m, t in weights if plan.mine(k, m)]
    with TrainerClient(addr, timeout=120.0) as client:
        print(json.dumps({"ready": k, "bytes": plan.loads[k]}), flush=True)
        for line in sys.stdin:
            _, version, transport, bucket_bytes, window = line.split()
            t0 = time.perf_counter()
            r = client.push(
                mine,
                int(version),
                source=(k, n) if n > 1 else None,
                plan=plan.key if n > 1 else None,
                transport=transport,
                bucket_bytes=int(bucket_bytes),
                window=int(window),
            )
            print(
                json.dumps(
                    {
                        "state": r.state,
                        "sync_id": r.sync_id,
                        "digest": r.digest,
                        "engines": [e["digest"] for e in r.engines],
                        "seconds": time.perf_counter() - t0,
                        "bytes": r.bytes,
                        "transport": r.detail.get("transport"),
                    }
                ),
                flush=True,
            )


class Sources:
    """`n` source processes of one trainer, pushing together on command."""

    def __init__(self, spec_dir: Path, addr: str, n: int) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.sharded", "--worker", str(spec_dir), addr, str(k), str(n)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for k in range(n)
        ]
        for p in self.procs:
            self._read(p)

    @staticmethod
    def _read(p: subprocess.Popen[str]) -> dict[str, Any]:
        line = p.stdout.readline() if p.stdout is not None else ""
        if not line:
            raise RuntimeError(f"source process {p.pid} exited ({p.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def push(
        self, version: int, transport: str, bucket_bytes: int, window: int
    ) -> tuple[float, list[dict[str, Any]]]:
        """One sharded sync: wall seconds from the command to the last source's READY."""
        t0 = time.perf_counter()
        for p in self.procs:
            if p.stdin is None:
                raise RuntimeError(f"source process {p.pid} has no stdin")
            p.stdin.write(f"push {version} {transport} {bucket_bytes} {window}\n")
            p.stdin.flush()
        results = [self._read(p) for p in self.procs]
        wall = time.perf_counter() - t0
        digests = {r["digest"] for r in results} | {d for r in results for d in r["engines"]}
        if (
            {r["state"] for r in results} != {"READY"}
            or len({r["sync_id"] for r in results}) != 1
            or len(digests) != 1
        ):
            raise RuntimeError(f"sync v{version} not verified: {results}")
        return wall, results

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def run(
    work: Path,
    spec_dir: Path,
    model_bytes: int,
    sources: list[int],
    engines: int,
    transports: list[str],
    bucket_bytes: int,
    window: int,
    repeats: int,
    log: Any = print,
) -> dict[str, Any]:
    from examples.launch import Cluster

    points: list[dict[str, Any]] = []
    with Cluster(
        work / "sources",
        spec_dir,
        engines=engines,
        backend="sink",
        daemon_args=["--log-level", "warning"],
        engine_args=["--log-level", "warning"],
    ) as cluster:
        version = 0
        for transport in transports:
            for n in sources:
                src = Sources(spec_dir, cluster.addr, n)
                try:
                    version += 1
                    src.push(version, transport, bucket_bytes, window)  # warm-up
                    walls, chosen = [], ""
                    for _ in range(repeats):
                        version += 1
                        wall, results = src.push(version, transport, bucket_bytes, window)
                        walls.append(wall)
                        chosen = results[0]["transport"]
                finally:
                    src.close()
                med = statistics.median(walls)
                point = {
                    "transport": transport,
                    "chosen_transport": chosen,
                    "sources": n,
                    "engines": engines,
                    "model_bytes": model_bytes,
                    "bucket_bytes": bucket_bytes,
                    "seconds": med,
                    "seconds_min": min(walls),
                    "seconds_max": max(walls),
                    "gbps": model_bytes / med / 1e9,
                    "repeats": walls,
                }
                points.append(point)
                log(
                    f"  {transport:6s} sources={n} engines={engines} bucket={bucket_bytes // MiB} MiB  "
                    f"{med * 1e3:8.1f} ms per sync [{min(walls) * 1e3:.1f}-{max(walls) * 1e3:.1f}]  "
                    f"{point['gbps']:.2f} GB/s"
                )
    for p in points:
        one = next(q for q in points if q["transport"] == p["transport"] and q["sources"] == min(sources))
        p["ratio_to_fewest"] = p["seconds"] / one["seconds"]
    return {"points": points, "baseline": f"{min(sources)} source(s), same transport, same run"}


def table(result: dict[str, Any]) -> str:
    rows = [
        "| transport | sources | ms per sync (median [min-max]) | GB/s | x fewest sources |",
        "|---|---|---|---|---|",
    ]
    for p in result["points"]:
        rows.append(
            f"| {p['chosen_transport']} | {p['sources']} | {p['seconds'] * 1e3:.1f} "
            f"[{p['seconds_min'] * 1e3:.1f}-{p['seconds_max'] * 1e3:.1f}] | {p['gbps']:.2f} | "
            f"{p['ratio_to_fewest']:.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit("usage: python -m bench --sources 1,2,4 (this module's --worker is its own)")
