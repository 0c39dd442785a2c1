"""`python -m bench` (also `weightsync bench`): weightsync's data plane against raw ZeroMQ
and memcpy, measured in one run over the same bytes and bucket sizes.

For each engine count a real daemon and real sink-engine processes are started (the sink
engine validates, copies into preallocated tensors and digests, so the data plane is
measured, not model code); this process is the trainer and pushes the model with every
transport and bucket size. `gbps` is model bytes over the sync's wall time (begin to
READY, digests verified), not multiplied by the number of engines.

Peak RSS is the kernel's high-water mark (VmHWM), reset through /proc/PID/clear_refs
before each sync: the daemon's is absolute, the trainer's is what the sync added on top
of the model it already held.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str) -> int:
    """'1GiB', '64MiB', '4096' -> bytes."""
    t = text.strip()
    for suffix, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10), ("G", GiB), ("M", MiB),
                         ("K", 1 << 10)):
        if t.endswith(suffix):
            return int(float(t[:-len(suffix)]) * mult)
    return int(t)


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x]


def reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def peak_rss_mib(pid: int) -> float:
    return _status_kib(pid, "VmHWM") / 1024


def rss_mib(pid: int) -> float:
    return _status_kib(pid, "VmRSS") / 1024


@dataclass
class Run:
    transport: str
    engines: int
    bucket_bytes: int
    model_bytes: int
    window: int
    seconds: float
    gbps: float
    ratio_zmq: float
    ratio_memcpy: float
    orchestrator_rss_mib: float
    trainer_rss_mib: float
    chosen_transport: str
    buckets: int


def push_once(client: Any, weights: list, version: int, bucket_bytes: int, window: int,
              transport: str, daemon_pid: int) -> tuple[Any, float, float]:
    """One verified sync; returns (result, daemon peak MiB, trainer peak growth MiB)."""
    me = os.getpid()
    reset_peak(daemon_pid)
    reset_peak(me)
    before = rss_mib(me)
    r = client.push(weights, version, bucket_bytes=bucket_bytes, window=window,
                    transport=transport)
    bad = [e["engine_id"] for e in r.engines if e["digest"] != r.digest]
    if r.state != "READY" or bad:
        raise RuntimeError(f"sync v{version} not verified: state {r.state}, wrong digest on {bad}")
    return r, peak_rss_mib(daemon_pid), peak_rss_mib(me) - before


def sweep(workdir: Path, spec_dir: Path, weights: list, model_bytes: int, engines: Sequence[int],
          transports: Sequence[str], buckets: Sequence[int], window: int, repeats: int,
          baselines: dict[str, float], log: Any = print) -> list[Run]:
    from examples.launch import Cluster

    runs: list[Run] = []
    for n in engines:
        with Cluster(workdir / f"e{n}", spec_dir, engines=n, backend="sink",
                     daemon_args=["--log-level", "warning"],
                     engine_args=["--log-level", "warning"]) as cluster, \
                cluster.client(timeout=120.0) as client:
            version = 0
            for bucket_bytes in buckets:
                for transport in transports:
                    results = []
                    for _ in range(repeats):
                        version += 1
                        results.append(push_once(client, weights, version, bucket_bytes, window,
                                                 transport, cluster.daemon.popen.pid))
                    r, daemon_peak, trainer_peak = min(results, key=lambda x: x[0].seconds)
                    gbps = model_bytes / r.seconds / 1e9
                    run = Run(transport, n, bucket_bytes, model_bytes, window, r.seconds, gbps,
                              gbps / baselines["zmq_gbps"], gbps / baselines["memcpy_gbps"],
                              max(x[1] for x in results), max(x[2] for x in results),
                              r.detail.get("transport", transport), r.buckets)
                    runs.append(run)
                    log(f"  {transport:6s} engines={n} bucket={bucket_bytes // MiB:4d} MiB  "
                        f"{gbps:6.2f} GB/s  x{run.ratio_zmq:.2f} zmq  x{run.ratio_memcpy:.2f} memcpy  "
                        f"daemon {run.orchestrator_rss_mib:.0f} MiB  trainer +{run.trainer_rss_mib:.0f} MiB")
    return runs


def control_overhead(workdir: Path, count: int, window: int) -> dict[str, Any]:
    """Buckets per second with tiny buckets: the per-bucket cost of FSM, acks and relays."""
    from engines.sink import random_weights, write_spec
    from messages.schema import ParamSpec
    from examples.launch import Cluster

    spec = [ParamSpec(f"t.{i}", "float32", (16,)) for i in range(count)]
    spec_dir = write_spec(workdir / "tiny-spec", spec)
    weights = list(random_weights(spec, seed=1))
    with Cluster(workdir / "control", spec_dir, engines=1, backend="sink",
                 daemon_args=["--log-level", "warning"],
                 engine_args=["--log-level", "warning"]) as cluster, \
            cluster.client(timeout=60.0) as client:
        best = None
        for v in (1, 2, 3):
            r = client.push(weights, v, bucket_bytes=64, window=window, transport="inline")
            if best is None or r.seconds < best.seconds:
                best = r
    return {"buckets": best.buckets, "window": window, "seconds": best.seconds,
            "buckets_per_s": best.buckets / best.seconds}


def plot(runs: list[Run], path: Path, baselines: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r.transport, r.bucket_bytes) for r in runs})
    for transport, bucket in keys:
        pts = sorted((r.engines, r.gbps) for r in runs if (r.transport, r.bucket_bytes) == (transport, bucket))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{transport}, {bucket // MiB} MiB buckets")
    ax.axhline(baselines["zmq_gbps"], ls="--", color="gray", label="raw ZeroMQ (1 receiver)")
    ax.axhline(baselines["memcpy_gbps"], ls=":", color="black", label="memcpy")
    ax.set_xlabel("engines")
    ax.set_ylabel("GB/s (model bytes / sync wall time)")
    ax.set_xticks(sorted({r.engines for r in runs}))
    ax.set_title(f"weightsync sync throughput, model {runs[0].model_bytes / GiB:.2f} GiB")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(runs: list[Run], baselines: dict[str, float], control: dict[str, Any] | None) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"baselines: raw ZeroMQ {baselines['zmq_gbps']:.2f} GB/s, "
                    f"memcpy {baselines['memcpy_gbps']:.2f} GB/s", title_justify="left")
    for col in ("transport", "engines", "bucket MiB", "GB/s", "x zmq", "x memcpy", "sync s",
                "daemon peak MiB", "trainer +MiB"):
        t.add_column(col, justify="right")
    for r in runs:
        t.add_row(r.chosen_transport, str(r.engines), str(r.bucket_bytes // MiB), f"{r.gbps:.2f}",
                  f"{r.ratio_zmq:.2f}", f"{r.ratio_memcpy:.2f}", f"{r.seconds:.3f}",
                  f"{r.orchestrator_rss_mib:.0f}", f"{r.trainer_rss_mib:.0f}")
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(t)
    if control:
        console.print(f"control overhead: {control['buckets']} tiny buckets in "
                      f"{control['seconds']:.3f}s = {control['buckets_per_s']:.0f} buckets/s "
                      f"(window {control['window']}, 1 engine)")
    return console.export_text()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model-bytes", default="1GiB", help="model size, e.g. 1GiB, 4GiB")
    ap.add_argument("--tensor-bytes", default="16MiB", help="size of each model tensor")
    ap.add_argument("--engines", default="1,2,4", help="engine counts, comma-separated")
    ap.add_argument("--transports", default="inline,shm")
    ap.add_argument("--bucket-bytes", default="16MiB,64MiB", help="bucket sizes, comma-separated")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="syncs per point (the fastest counts)")
    ap.add_argument("--control-buckets", type=int, default=5000,
                    help="tiny buckets for the control-overhead run (0 skips it)")
    ap.add_argument("--control-window", type=int, default=32)
    ap.add_argument("--collective-engines", default="1,2,4",
                    help="engine counts for the collective-vs-raw-broadcast run ('' skips it)")
    ap.add_argument("--collective-repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench-out/throughput.json"))
    ap.add_argument("--plot", type=Path, default=Path("bench-out/throughput.png"))
    args = ap.parse_args(argv)

    import torch

    from bench.baselines import memcpy_gbps, zmq_gbps
    from engines.sink import random_weights, synthetic_spec, write_spec

    torch.set_num_threads(1)  # the trainer packs on one core; the engines get the other
    model_bytes = parse_size(args.model_bytes)
    buckets = _sizes(args.bucket_bytes)
    engines = [int(x) for x in args.engines.split(",") if x]
    transports = [x for x in args.transports.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        work = Path(tmp)
        spec = synthetic_spec(model_bytes, parse_size(args.tensor_bytes))
        spec_dir = write_spec(work / "spec", spec)
        t0 = time.perf_counter()
        weights = list(random_weights(spec))
        model_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        print(f"model: {len(weights)} tensors, {model_bytes / GiB:.2f} GiB "
              f"(made in {time.perf_counter() - t0:.1f}s); buckets {[b // MiB for b in buckets]} MiB, "
              f"window {args.window}")
        ref_bucket = statistics.median_low(buckets)
        baselines = {"zmq_gbps": zmq_gbps(work, weights, ref_bucket),
                     "memcpy_gbps": memcpy_gbps(weights), "bucket_bytes": ref_bucket}
        print(f"baselines over the model's {model_bytes / GiB:.2f} GiB, {ref_bucket // MiB} MiB messages: "
              f"raw ZeroMQ {baselines['zmq_gbps']:.2f} GB/s, memcpy {baselines['memcpy_gbps']:.2f} GB/s")
        runs = sweep(work, spec_dir, weights, model_bytes, engines, transports, buckets,
                     args.window, args.repeats, baselines)
        coll_engines = [int(x) for x in args.collective_engines.split(",") if x]
        collective = None
        if coll_engines:
            from bench.collective import run as run_collective
            collective = run_collective(work, spec_dir, weights, model_bytes, coll_engines,
                                        ref_bucket, args.window, args.collective_repeats)
        del weights
        control = (control_overhead(work, args.control_buckets, args.control_window)
                   if args.control_buckets else None)
    print(table(runs, baselines, control))
    if collective is not None:
        from bench.collective import table as collective_table
        print(collective_table(collective))
    result = {"baselines": baselines, "runs": [asdict(r) for r in runs], "control": control,
              "collective": collective}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    if args.plot and runs:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, args.plot, baselines)
        print(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    main()
