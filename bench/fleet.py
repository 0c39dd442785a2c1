"""`python -m bench.fleet`: what a sync costs the real daemon as the fleet grows.

It starts the real `weightsync serve` process and N simulated engines (bench.simengine:
the real engine protocol over real ZeroMQ sockets, up to 64 engines per process, no
torch), and this process drives real syncs through the real `TrainerClient`:

- collective: the trainer's group is simulated (`SimGroup`: nothing is broadcast; the
  engines "receive" each bucket when the daemon announces it), the control plane is not;
- inline: real frames of `--bucket-bytes` (default 64 B) through the daemon to every engine.

For each (transport, engines) point it runs one warm-up sync, then `--repeats` syncs of
`--buckets` buckets, and reports medians: the daemon's CPU seconds per sync (utime+stime
from /proc), the messages it received and sent during the sync (its own counters; the
engines' heartbeats and the two `status` calls that read the counters are left out), the
trainer's wall seconds, and the daemon's peak RSS. `fit` is a least-squares line of daemon
CPU per bucket against engines, per transport: `per_bucket_us` (the intercept) and
`per_engine_bucket_us` (the slope). With the largest fleet it also measures how long the
engines take to register, what idle heartbeats cost the daemon, and `status` latency.

    python -m bench.fleet --engines 1,16,64,256 --buckets 2000 --transports collective,inline \
        --repeats 3 --json fleet.json --check
    python -m bench.fleet --sources 1,8 --engines 64 --buckets 2000 --check

`--sources` measures a sharded push instead: the same buckets from 1 and from N sources
(each its own connection and thread, `push(source=(k, N))`), inline, at the largest
`--engines`, and checks the daemon's CPU and messages per sync with N within 1.2x of 1.

`--check` exits 1 naming every missed target (docs/BENCHMARKS.md lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import zmq

from bench.common import machine, peak_rss_mib, reset_peak
from examples.launch import Cluster
from messages import schema, stream
from messages.buckets import digest
from messages.distgroup import GroupError
from orchestrator.trainer.group import TrainerGroup

PER_PROCESS = 64  # simulated engines per simulator process


class SimGroup(TrainerGroup):
    """Rank 0 of a simulated data plane: the daemon plans a real group; no weight byte is
    sent. On the collective stream the frame headers are real: each is published (with
    the sync's id) on `pub`, a ZeroMQ PUB socket the simulator processes subscribe to,
    so the engines verify the chain and prepare from what the trainer really sent."""

    def __init__(self, pub: Any = None) -> None:
        super().__init__("tcp://127.0.0.1:1", host="127.0.0.1")
        self.broadcasts = 0
        self.pub = pub
        self._payload_next = False  # a BUCKET header is followed by its payload

    def offer(self) -> schema.CollectiveOffer:
        return schema.CollectiveOffer(
            host=self.host, port=1, session=self.session, backends=("gloo",), stream=self.pub is not None
        )

    def start(self, data: Any, seq: int, give_up: Callable[[], str | None] | None = None) -> None:
        self.broadcasts += 1
        self.pending_seq = seq
        planned = self.planned or {}
        if not planned.get("stream") or self.pub is None:
            return
        if self._payload_next:  # the bucket's bytes: simulated, never sent
            self._payload_next = False
            return
        head = bytes(data.numpy())
        self._payload_next = stream.decode_header(head).kind == stream.BUCKET
        self.pub.send_multipart([planned["sync_id"].encode(), head])

    def wait(self, give_up: Callable[[], str | None]) -> None:
        self.pending_seq = None
        reason = give_up()  # as a real broadcast does while it waits: the daemon's error stops it
        if reason is not None:
            raise GroupError(f"broadcast abandoned: {reason}")

    def fail(self) -> None:
        self.pending_seq = None
        self._payload_next = False

    def close(self) -> None:
        self.pending_seq = None


class SimFleet:
    """A real daemon and N simulated engines in `workdir`."""

    def __init__(
        self,
        workdir: Path,
        engines: int,
        *,
        daemon_args: Sequence[str] = (),
        faults: dict[str, str] | None = None,
        heartbeat: float = 1.0,
        digest_bytes: bool = True,
    ) -> None:
        self.workdir = Path(workdir)
        self.digest_bytes = digest_bytes  # engines digest what they received (tests), or not (timing)
        self.n = engines
        self.digests = self.workdir / "digests"
        self.digests.mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(
            self.workdir,
            engines=0,
            min_engines=engines,
            daemon_args=["--log-level", "warning", *daemon_args],
        )
        self.faults = faults or {}
        self.heartbeat = heartbeat
        self.sims: list[subprocess.Popen[bytes]] = []
        self.ids = [f"sim-{i}" for i in range(engines)]
        self.data_plane = f"ipc://{self.workdir}/data-plane.sock"  # the streams' headers
        self.pub: Any = None

    def start(self, timeout: float = 60.0) -> float:
        """Start the daemon and the engines; the seconds the engines took to register."""
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop a header
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.data_plane)
        self.cluster.start_daemon()
        self.cluster.wait_engines(0, timeout=30.0)
        t0 = time.monotonic()
        for i in range(0, self.n, PER_PROCESS):
            self.start_sims(self.ids[i : i + PER_PROCESS])
        self.wait_registered(self.n, timeout)
        return time.monotonic() - t0

    def start_sims(self, ids: Sequence[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"sims-{len(self.sims)}.log", "ab")
        faults = [f"--fault={k}={v}" for k, v in self.faults.items() if k in ids]
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.simengine",
                "--connect",
                self.cluster.engine_addr,
                "--ids",
                ",".join(ids),
                "--digests",
                str(self.digests),
                "--heartbeat",
                str(self.heartbeat),
                "--data-plane",
                self.data_plane,
                *([] if self.digest_bytes else ["--no-digest-bytes"]),
                *faults,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.sims.append(p)
        return p

    def wait_registered(self, n: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.cluster.status(timeout=5.0)
            live = [e for e in st["engines"] if e["state"] != "LOST"]
            subscribed = not st["daemon"].get("fanout_addr") or st["daemon"]["fanout_subscribers"] >= n
            if len(live) >= n and subscribed:  # and, with a fan-out, subscribed to it
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(live)}/{n} simulated engines registered in {timeout}s")
            for p in self.sims:
                if p.poll() is not None:
                    raise RuntimeError(f"a simulator process exited with {p.returncode}")
            time.sleep(0.05)

    @property
    def daemon_pid(self) -> int:
        return self.cluster.daemon.popen.pid

    def client(self, **kw: Any) -> Any:
        c = self.cluster.client(**kw)
        c.routes.group = SimGroup(self.pub)
        return c

    def write_digest(self, version: int, weights: Sequence[tuple[str, Any]]) -> str:
        d = digest(weights)
        (self.digests / str(version)).write_text(d)
        return d

    def stop(self) -> None:
        for p in self.sims:
            if p.poll() is None:
                p.terminate()
        for p in self.sims:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.cluster.stop()
        if self.pub is not None:
            self.pub.close(linger=0)
            self.pub = None

    def __enter__(self) -> SimFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def tiny_weights(count: int, version: int) -> list[tuple[str, Any]]:
    """`count` tensors of 16 float32 (64 bytes: one bucket each), different per version."""
    import torch

    base = torch.arange(16, dtype=torch.float32)
    return [(f"t.{i}", base + (i * 1000 + version)) for i in range(count)]


def _counters(fleet: SimFleet, client: Any) -> tuple[float, int, int]:
    st = client.status()["daemon"]
    cpu = psutil.Process(fleet.daemon_pid).cpu_times()
    return cpu.user + cpu.system, st["messages_received"] + st["messages_sent"], st["heartbeats_received"]


def _push_sources(
    fleet: SimFleet, clients: list[Any], weights: list[tuple[str, Any]], v: int, transport: str, window: int
) -> list[Any]:
    """A sharded push: source k (its own connection, its own thread) sends every
    len(clients)-th tensor; one sync. Returns each source's result."""
    n = len(clients)
    if n == 1:
        return [clients[0].push(weights, v, bucket_bytes=64, window=window, transport=transport)]
    results: list[Any] = [None] * n

    def run(k: int) -> None:
        try:
            results[k] = clients[k].push(
                weights[k::n], v, bucket_bytes=64, window=window, transport=transport, source=(k, n)
            )
        except BaseException as exc:  # reported below, with the others' outcome
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        raise RuntimeError(f"sync {v}: {len(bad)} of {n} sources failed: {bad[0]}")
    return results


def measure(
    workdir: Path,
    transport: str,
    engines: int,
    buckets: int,
    repeats: int,
    window: int = 32,
    sources: int = 1,
) -> dict[str, Any]:
    """One point: medians of `repeats` syncs after a warm-up. `sources` > 1: a sharded
    push of the same buckets from that many connections (bench.fleet --sources)."""
    # the simulated engines hash nothing: the benchmark times the daemon, not their Python
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(SimFleet(workdir, engines, digest_bytes=False))
        clients = [stack.enter_context(fleet.client(timeout=120.0)) for _ in range(sources)]
        client = clients[0]
        samples: list[dict[str, float]] = []
        for v in range(1, repeats + 2):
            weights = tiny_weights(buckets, v)
            fleet.write_digest(v, weights)
            reset_peak(fleet.daemon_pid)
            cpu0, msgs0, hb0 = _counters(fleet, client)
            t0 = time.perf_counter()
            rs = _push_sources(fleet, clients, weights, v, transport, window)
            wall = time.perf_counter() - t0
            cpu1, msgs1, hb1 = _counters(fleet, client)
            r = rs[0]
            sent, counted = sum(x.buckets for x in rs), r.detail.get("buckets")
            if {x.state for x in rs} != {"READY"} or sent != buckets or counted != buckets:
                raise RuntimeError(
                    f"sync {v} ended {r.state}: {sent} buckets sent, the daemon counted {counted}"
                )
            if len({x.sync_id for x in rs}) != 1 or {x.digest for x in rs} != {
                fleet.write_digest(v, weights)
            }:
                raise RuntimeError(f"sync {v}: the sources did not end in one sync with the version's digest")
            if r.detail.get("transport") != transport:
                raise RuntimeError(f"asked for {transport}, the daemon chose {r.detail.get('transport')}")
            if v == 1:
                continue  # the warm-up
            samples.append(
                {
                    "daemon_cpu_s": cpu1 - cpu0,
                    # the status reply before and the status request after are not the sync's
                    "daemon_msgs": (msgs1 - msgs0) - (hb1 - hb0) - 2,
                    "wall_s": wall,
                    "daemon_rss_mib": peak_rss_mib(fleet.daemon_pid),
                }
            )
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    return {
        "transport": transport,
        "engines": engines,
        "buckets": buckets,
        "sources": sources,
        "daemon_cpu_s": round(med["daemon_cpu_s"], 4),
        "daemon_msgs": int(med["daemon_msgs"]),
        "wall_s": round(med["wall_s"], 4),
        "daemon_rss_mib": round(med["daemon_rss_mib"], 1),
    }


def fleet_wide(workdir: Path, engines: int, idle_s: float = 5.0) -> dict[str, float]:
    """Registration, idle heartbeats and `status` with the whole fleet up."""
    fleet = SimFleet(workdir, engines, digest_bytes=False)
    try:
        register_s = fleet.start(timeout=120.0)
        proc = psutil.Process(fleet.daemon_pid)
        time.sleep(1.0)
        c0 = proc.cpu_times()
        time.sleep(idle_s)
        c1 = proc.cpu_times()
        idle = (c1.user + c1.system - c0.user - c0.system) / idle_s
        with fleet.client(timeout=10.0) as client:
            lat = []
            for _ in range(5):
                t0 = time.perf_counter()
                client.status()
                lat.append(time.perf_counter() - t0)
    finally:
        fleet.stop()
    return {
        "engines": engines,
        "register_s": round(register_s, 3),
        "idle_cpu_pct": round(idle * 100, 2),
        "status_ms": round(statistics.median(lat) * 1e3, 2),
    }


def fit(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Daemon CPU per bucket = per_bucket + per_engine_bucket x engines, per transport."""
    out = {}
    for t in sorted({r["transport"] for r in runs}):
        pts = [(r["engines"], r["daemon_cpu_s"] / r["buckets"] * 1e6) for r in runs if r["transport"] == t]
        if len(pts) < 2:
            out[t] = {"per_bucket_us": round(pts[0][1], 2), "per_engine_bucket_us": None}
            continue
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
        out[t] = {"per_bucket_us": round(my - slope * mx, 2), "per_engine_bucket_us": round(slope, 3)}
    return out


def missed_targets(
    runs: list[dict[str, Any]], fits: dict[str, Any], wide: dict[str, float] | None
) -> list[str]:
    """Every target of docs/BENCHMARKS.md's fleet section; one whose point this run did not
    measure is missed too ("not run"), so `--check` never passes a target it skipped."""
    missed = []
    by = {(r["transport"], r["engines"]): r for r in runs}
    top = by.get(("collective", 256))
    if top is None:
        missed.append("collective 256 engines: not run (its CPU, message and wall targets need it)")
    elif by.get(("collective", 1)) is None:
        missed.append("collective 1 engine: not run (the wall target compares 256 engines with it)")
    if top is not None:
        if top["daemon_cpu_s"] > 1.0:
            missed.append(f"collective 256 engines: daemon CPU {top['daemon_cpu_s']:.2f}s per sync > 1.0s")
        limit = 4 * 256 + 16
        if top["daemon_msgs"] > limit:
            missed.append(f"collective 256 engines: {top['daemon_msgs']} daemon messages per sync > {limit}")
        one = by.get(("collective", 1))
        if one is not None and top["wall_s"] > 2 * one["wall_s"]:
            missed.append(
                f"collective: sync wall {top['wall_s']:.2f}s with 256 engines > 2x {one['wall_s']:.2f}s with 1"
            )
    slope = fits.get("inline", {}).get("per_engine_bucket_us")
    if slope is None or len({r["engines"] for r in runs if r["transport"] == "inline"}) < 2:
        missed.append("inline: not run at two fleet sizes (the per-engine-bucket target is their fit)")
    elif slope > 5.0:
        missed.append(f"inline: daemon CPU per bucket grows {slope:.1f}us per extra engine > 5us")
    if wide is None or wide["engines"] < 256:
        missed.append("fleet-wide at 256 engines: not run (registration, idle CPU, status targets)")
    if wide is not None:
        if wide["engines"] >= 256 and wide["register_s"] > 1.0:
            missed.append(f"{wide['engines']} engines registered in {wide['register_s']:.2f}s > 1s")
        if wide["idle_cpu_pct"] > 5.0:
            missed.append(
                f"{wide['engines']} idle engines cost the daemon {wide['idle_cpu_pct']:.1f}% of a core > 5%"
            )
        if wide["status_ms"] > 100.0:
            missed.append(f"status with {wide['engines']} engines took {wide['status_ms']:.0f}ms > 100ms")
    return missed


SOURCES_TARGET = 1.2  # daemon CPU and messages per sync, most sources over one


def sources_missed(runs: list[dict[str, Any]]) -> list[str]:
    """The sharded push's target: the daemon's work per sync does not grow with sources."""
    one = next((r for r in runs if r["sources"] == 1), None)
    most = max(runs, key=lambda r: r["sources"])
    if one is None or most["sources"] == 1:
        return ["sources: not run with 1 and with several sources (the target compares them)"]
    missed = []
    for key, what in (("daemon_cpu_s", "daemon CPU"), ("daemon_msgs", "daemon messages")):
        ratio = most[key] / one[key] if one[key] else float("inf")
        if ratio > SOURCES_TARGET:
            missed.append(
                f"{what} per sync with {most['sources']} sources {most[key]} = {ratio:.2f}x one "
                f"source's {one[key]} > {SOURCES_TARGET}x"
            )
    return missed


def sources_main(args: argparse.Namespace, engines: int, counts: list[int]) -> int:
    runs = []
    with tempfile.TemporaryDirectory(prefix="ws-fleet-") as tmp:
        for n in counts:
            r = measure(
                Path(tmp) / f"sources-{n}-{uuid.uuid4().hex[:6]}",
                "inline",
                engines,
                args.buckets,
                args.repeats,
                sources=n,
            )
            runs.append(r)
            print(
                f"{n:3d} source(s), {engines} engines x {r['buckets']} buckets: daemon {r['daemon_cpu_s']:.3f} s "
                f"CPU, {r['daemon_msgs']} msgs, wall {r['wall_s']:.3f} s, peak RSS {r['daemon_rss_mib']:.0f} MiB",
                flush=True,
            )
    one = next((r for r in runs if r["sources"] == 1), None)
    if one is not None:
        for r in runs:
            print(
                f"ratio {r['sources']} source(s) / 1: daemon CPU {r['daemon_cpu_s'] / one['daemon_cpu_s']:.2f}x, "
                f"messages {r['daemon_msgs'] / one['daemon_msgs']:.2f}x, wall {r['wall_s'] / one['wall_s']:.2f}x"
            )
    missed = sources_missed(runs)
    for m in missed:
        print(f"MISSED {m}")
    if args.json is not None:
        args.json.write_text(json.dumps({"sources": runs, "missed": missed, "machine": machine()}, indent=1))
    return 1 if (missed and args.check) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,16,64,256")
    ap.add_argument("--buckets", type=int, default=2000)
    ap.add_argument("--transports", default="collective,inline")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--check", action="store_true", help="exit 1 naming every missed target")
    ap.add_argument("--no-fleet-wide", action="store_true", help="skip registration/idle/status")
    ap.add_argument(
        "--sources",
        default=None,
        help="a sharded push instead: these source counts (e.g. 1,8) push the same buckets, inline, "
        "at the largest --engines; --check: daemon CPU and messages per sync with the most sources "
        "within 1.2x of one source",
    )
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.engines.split(",")]
    if args.sources:
        return sources_main(args, max(counts), [int(x) for x in args.sources.split(",")])
    runs = []
    with tempfile.TemporaryDirectory(prefix="ws-fleet-") as tmp:
        for t in args.transports.split(","):
            for n in counts:
                r = measure(Path(tmp) / f"{t}-{n}-{uuid.uuid4().hex[:6]}", t, n, args.buckets, args.repeats)
                runs.append(r)
                print(
                    f"{t:10s} {n:4d} engines x {r['buckets']} buckets: daemon {r['daemon_cpu_s']:.3f} s CPU, "
                    f"{r['daemon_msgs']} msgs, wall {r['wall_s']:.3f} s, peak RSS {r['daemon_rss_mib']:.0f} MiB",
                    flush=True,
                )
        wide = None if args.no_fleet_wide else fleet_wide(Path(tmp) / "wide", max(counts))
    fits = fit(runs)
    for t, f in fits.items():
        print(
            f"fit {t}: {f['per_bucket_us']} us per bucket + {f['per_engine_bucket_us']} us per engine-bucket"
        )
    if wide is not None:
        print(
            f"fleet of {wide['engines']}: registered in {wide['register_s']} s, idle daemon "
            f"{wide['idle_cpu_pct']}% of a core, status {wide['status_ms']} ms"
        )
    missed = missed_targets(runs, fits, wide)
    for m in missed:
        print(f"MISSED {m}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"runs": runs, "fit": fits, "missed": missed, "machine": machine()}, indent=1)
        )
    return 1 if (missed and args.check) else 0


if __name__ == "__main__":
    raise SystemExit(main())
