"""The collective transport against a raw `torch.distributed.broadcast` of the same buckets,
at 1, 2 and 4 engines, in one run with interleaved repeats (raw, weightsync, raw, ...).

The raw peer is what a team would write without weightsync: the same packed buckets,
broadcast from rank 0 of a gloo group to N receiver processes, with nothing else (no
packing, no checksum, no acknowledgement, no FSM). weightsync's figure is a whole verified
sync (begin to READY: pack, checksum, broadcast, engine verify + copy, acks, finalize,
digests). Sink engines copy into preallocated tensors, so the data plane is measured, not
model code. The daemon's peak RSS and the bytes it received show it stays out of the
byte path (no spool here: nothing is copied to it).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from messages.keys import generate

RECEIVER = r"""
import json, sys, torch
from messages.distgroup import Group, GroupSpec
spec, sizes, repeats = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
g = Group(GroupSpec(**spec))
buf = torch.empty(max(sizes), dtype=torch.uint8)
for _ in range(repeats):
    for n in sizes:
        g.broadcast(buf[:n])
g.close()
"""


class RawBroadcast:
    """N receiver processes in their own gloo group with this process as rank 0."""

    def __init__(self, n: int, sizes: list[int], repeats: int, timeout: float = 600.0) -> None:
        import uuid

        from messages.rendezvous import StoreClient, StoreServer

        self.server = StoreServer("127.0.0.1")
        self.sizes = sizes
        self.store = StoreClient("127.0.0.1", self.server.port, self.server.token, timeout=timeout)
        gid = "raw-" + uuid.uuid4().hex[:8]
        self.procs = []
        for r in range(1, n + 1):
            spec = {
                "id": gid,
                "host": "127.0.0.1",
                "port": self.server.port,
                "token": self.server.token,
                "rank": r,
                "world_size": n + 1,
                "backend": "gloo",
                "timeout": timeout,
                "bind": "127.0.0.1",
            }
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RECEIVER, json.dumps(spec), json.dumps(sizes), str(repeats)]
                )
            )
        from messages.distgroup import Group, GroupSpec

        self.group = Group(
            GroupSpec(gid, "127.0.0.1", self.server.port, 0, n + 1, "gloo", timeout, "127.0.0.1"),
            store=self.store,
        )

    def once(self, buckets: list[Any]) -> float:
        t0 = time.perf_counter()
        for b in buckets:
            self.group.broadcast(b)
        return time.perf_counter() - t0

    def close(self) -> None:
        for p in self.procs:
            p.wait(60)
        self.group.close()
        self.store.close()
        self.server.close()


def run(
    workdir: Path,
    spec_dir: Path,
    weights: list,
    model_bytes: int,
    engines: list[int],
    bucket_bytes: int,
    window: int,
    repeats: int,
    log: Any = print,
) -> dict[str, Any]:
    from bench.common import peak_rss_mib, reset_peak
    from examples.launch import Cluster
    from messages.buckets import iter_buckets

    packed = [b.data.clone() for b in iter_buckets(weights, bucket_bytes)]
    sizes = [int(b.numel()) for b in packed]
    points: list[dict[str, Any]] = []
    mac_points: list[dict[str, Any]] = []
    keys_dir = workdir / "coll-keys"
    generate(keys_dir, ["trainer"], ["engine"])
    for n, keyed in [(n, False) for n in engines] + [(engines[0], True)]:
        # The last point repeats the first engine count with --keys: CURVE on the control
        # plane and the store, a BLAKE3 MAC on every bucket (its cost, against raw).
        raw = RawBroadcast(n, sizes, repeats + 1)
        raw.once(packed)  # warm-up: connections, first-touch of buffers
        with (
            Cluster(
                workdir / f"coll-e{n}{'-keys' if keyed else ''}",
                spec_dir,
                engines=n,
                backend="sink",
                daemon_args=["--log-level", "warning"],
                engine_args=["--log-level", "warning"] + (["--key-name", "engine"] if keyed else []),
                keys=keys_dir if keyed else None,
            ) as cluster,
            cluster.client(timeout=120.0) as client,
        ):
            pid = cluster.daemon.popen.pid
            client.push(weights, 1, bucket_bytes=bucket_bytes, window=window, transport="collective")
            before = client.status()["daemon"]["bytes_received"]
            reset_peak(pid)
            raw_s, ws_s = [], []
            for i in range(repeats):  # interleaved: raw, weightsync, raw, weightsync, ...
                raw_s.append(raw.once(packed))
                r = client.push(
                    weights, 2 + i, bucket_bytes=bucket_bytes, window=window, transport="collective"
                )
                bad = [e["engine_id"] for e in r.engines if e["digest"] != r.digest]
                if r.state != "READY" or bad or r.detail.get("transport") != "collective":
                    raise RuntimeError(f"collective sync not verified: {r.state}, {bad}, {r.detail}")
                ws_s.append(r.seconds)
            st = client.status()
            point = {
                "engines": n,
                "keys": keyed,
                "raw_seconds": raw_s,
                "weightsync_seconds": ws_s,
                "raw_median_s": statistics.median(raw_s),
                "weightsync_median_s": statistics.median(ws_s),
                "daemon_peak_rss_mib": round(peak_rss_mib(pid), 1),
                "daemon_bytes_received": st["daemon"]["bytes_received"] - before,
                "world_size": st["collective"]["world_size"],
            }
        raw.close()
        point["ratio_vs_raw"] = point["raw_median_s"] / point["weightsync_median_s"]
        point["gbps"] = model_bytes / point["weightsync_median_s"] / 1e9
        if keyed:
            mac_points.append(point)
        else:
            points.append(point)
        log(
            f"  collective engines={n}{' --keys' if keyed else ''}: weightsync {point['weightsync_median_s']:.3f}s "
            f"({point['gbps']:.2f} GB/s), raw broadcast {point['raw_median_s']:.3f}s, "
            f"x{point['ratio_vs_raw']:.2f} of raw; daemon {point['daemon_peak_rss_mib']:.0f} MiB, "
            f"received {point['daemon_bytes_received']} bytes"
        )
    one = next((p for p in points if p["engines"] == 1), None)
    scaling = (
        {p["engines"]: p["weightsync_median_s"] / one["weightsync_median_s"] for p in points} if one else {}
    )
    keyed = mac_points[0] if mac_points else None
    plain = next((p for p in points if keyed and p["engines"] == keyed["engines"]), None)
    return {
        "bucket_bytes": bucket_bytes,
        "model_bytes": model_bytes,
        "repeats": repeats,
        "points": points,
        "wall_vs_one_engine": scaling,
        # --keys (CURVE + a BLAKE3 MAC per bucket) vs no keys, each against raw broadcast
        # measured interleaved in its own run; and the MAC's own speed on these buckets
        "keys": {
            "point": keyed,
            "ratio_vs_raw_plain": plain["ratio_vs_raw"] if plain else None,
            "ratio_vs_raw_keys": keyed["ratio_vs_raw"] if keyed else None,
            "hash_gbps": _hash_speeds(packed),
        },
    }


def _hash_speeds(packed: list[Any]) -> dict[str, float]:
    """GB/s of the bucket checksum (xxh3) and of the keyed MAC (BLAKE3) over these buckets."""
    import xxhash

    from messages.stream import Header, bucket_mac

    key, h = b"k" * 32, Header(1, 0, 0, 0, 0)
    views = [b.numpy() for b in packed]
    total = sum(v.nbytes for v in views)
    out = {}
    for name, fn in (
        ("xxh3", lambda v: xxhash.xxh3_64_intdigest(v)),
        ("blake3_mac", lambda v: bucket_mac(key, h, v, b"")),
    ):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for v in views:
                fn(v)
            best = min(best, time.perf_counter() - t0)
        out[name] = round(total / best / 1e9, 2)
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "collective: weightsync vs raw torch.distributed.broadcast (medians, interleaved)",
        f"{'engines':>8} {'weightsync s':>13} {'raw s':>8} {'x raw':>6} {'x 1 engine':>11} "
        f"{'daemon MiB':>11} {'daemon rx B':>12}",
    ]
    for p in result["points"]:
        lines.append(
            f"{p['engines']:>8} {p['weightsync_median_s']:>13.3f} {p['raw_median_s']:>8.3f} "
            f"{p['ratio_vs_raw']:>6.2f} {result['wall_vs_one_engine'].get(p['engines'], 0):>11.2f} "
            f"{p['daemon_peak_rss_mib']:>11.0f} {p['daemon_bytes_received']:>12}"
        )
    k = result.get("keys") or {}
    if k.get("point"):
        p = k["point"]
        lines.append(
            f"--keys, {p['engines']} engine(s): {p['weightsync_median_s']:.3f}s, x{p['ratio_vs_raw']:.2f} "
            f"of raw (x{k['ratio_vs_raw_plain']:.2f} without keys); MAC {k['hash_gbps']['blake3_mac']} GB/s, "
            f"xxh3 {k['hash_gbps']['xxh3']} GB/s on these buckets"
        )
    lines.append("targets: x raw >= 0.90; 4 engines <= 1.20 x one engine; daemon rx = 0 bytes")
    return "\n".join(lines)
