"""`python -m bench` (also `weightsync bench`): weightsync's data plane against raw ZeroMQ
and memcpy, measured in one run over the same bytes and bucket sizes.

For each engine count a real daemon and real sink-engine processes are started (the sink
engine validates, copies into preallocated tensors and digests, so the data plane is
measured, not model code); this process is the trainer and pushes the model with every
transport and bucket size. `gbps` is model bytes over the sync's wall time (begin to
READY, digests verified), not multiplied by the number of engines.

Every point is one warm-up sync, then `--repeats` rounds in which a baseline round (raw
ZeroMQ and memcpy of the same bytes) and a sync alternate; figures are medians with
min/max, ratios are of medians, and the JSON keeps every repeat, the machine (cores,
memory) and the versions. `--check` exits 1 naming every missed target.

Peak RSS is the kernel's high-water mark (VmHWM), reset through /proc/PID/clear_refs
before each sync: the daemon's is absolute, the trainer's is what the sync added on top
of the model it already held.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    GiB,
    MiB,
    _sizes,
    cpu_used,
    machine,
    parse_size,
    peak_rss_mib,
    reset_peak,
    rss_mib,
)


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
    zmq_gbps: float = 0.0  # medians of the baselines measured between this point's syncs
    memcpy_gbps: float = 0.0
    gbps_min: float = 0.0
    gbps_max: float = 0.0
    repeats: list[dict[str, float]] | None = None  # every repeat: candidate and baselines


def push_once(
    client: Any, weights: list, version: int, bucket_bytes: int, window: int, transport: str, daemon_pid: int
) -> tuple[Any, float, float]:
    """One verified sync; returns (result, daemon peak MiB, trainer peak growth MiB)."""
    me = os.getpid()
    reset_peak(daemon_pid)
    reset_peak(me)
    before = rss_mib(me)
    r = client.push(weights, version, bucket_bytes=bucket_bytes, window=window, transport=transport)
    bad = [e["engine_id"] for e in r.engines if e["digest"] != r.digest]
    if r.state != "READY" or bad:
        raise RuntimeError(f"sync v{version} not verified: state {r.state}, wrong digest on {bad}")
    return r, peak_rss_mib(daemon_pid), peak_rss_mib(me) - before


def sweep(
    workdir: Path,
    spec_dir: Path,
    weights: list,
    model_bytes: int,
    engines: Sequence[int],
    transports: Sequence[str],
    buckets: Sequence[int],
    window: int,
    repeats: int,
    baselines: dict[str, float],
    log: Any = print,
) -> list[Run]:
    """Every point: one warm-up sync, then `repeats` rounds of baseline, candidate,
    baseline, candidate... (raw ZeroMQ and memcpy measured right before each sync), so a
    drift of the machine moves both; ratios are of the medians."""
    from bench.baselines import MemcpyBaseline, ZmqBaseline
    from examples.launch import Cluster

    runs: list[Run] = []
    memcpy = MemcpyBaseline(weights)
    for n in engines:
        with (
            Cluster(
                workdir / f"e{n}",
                spec_dir,
                engines=n,
                backend="sink",
                daemon_args=["--log-level", "warning"],
                engine_args=["--log-level", "warning"],
            ) as cluster,
            cluster.client(timeout=120.0) as client,
        ):
            pid = cluster.daemon.popen.pid
            version = 0
            for bucket_bytes in buckets:
                zmq_base = ZmqBaseline(workdir, weights, bucket_bytes)
                try:
                    for transport in transports:
                        version += 1  # warm-up: connections, slots, first touch of buffers
                        push_once(client, weights, version, bucket_bytes, window, transport, pid)
                        rows, results = [], []
                        for _ in range(repeats):
                            z, m = zmq_base.once(), memcpy.once()
                            version += 1
                            res = push_once(client, weights, version, bucket_bytes, window, transport, pid)
                            results.append(res)
                            rows.append(
                                {
                                    "seconds": res[0].seconds,
                                    "gbps": model_bytes / res[0].seconds / 1e9,
                                    "zmq_gbps": z,
                                    "memcpy_gbps": m,
                                }
                            )
                        # The trainer's memory, measured from scratch: the warm-up's shared-memory
                        # ring is released first, so its reservation counts (untimed push).
                        client.routes.drop_rings()
                        version += 1
                        fresh = push_once(client, weights, version, bucket_bytes, window, transport, pid)
                        run = _point(transport, n, bucket_bytes, model_bytes, window, rows, results, fresh[2])
                        runs.append(run)
                        log(
                            f"  {transport:6s} engines={n} bucket={bucket_bytes // MiB:4d} MiB  "
                            f"{run.gbps:6.2f} GB/s [{run.gbps_min:.2f}-{run.gbps_max:.2f}]  "
                            f"x{run.ratio_zmq:.2f} zmq  x{run.ratio_memcpy:.2f} memcpy  "
                            f"daemon {run.orchestrator_rss_mib:.0f} MiB  trainer +{run.trainer_rss_mib:.0f} MiB"
                        )
                finally:
                    zmq_base.close()
    return runs


def _point(
    transport: str,
    n: int,
    bucket_bytes: int,
    model_bytes: int,
    window: int,
    rows: list[dict[str, float]],
    results: list[Any],
    trainer_rss_mib: float,
) -> Run:
    med = {k: statistics.median(r[k] for r in rows) for k in ("seconds", "gbps", "zmq_gbps", "memcpy_gbps")}
    last = results[-1][0]
    return Run(
        transport,
        n,
        bucket_bytes,
        model_bytes,
        window,
        med["seconds"],
        med["gbps"],
        med["gbps"] / med["zmq_gbps"],
        med["gbps"] / med["memcpy_gbps"],
        max(x[1] for x in results),
        trainer_rss_mib,
        last.detail.get("transport", transport),
        last.buckets,
        zmq_gbps=med["zmq_gbps"],
        memcpy_gbps=med["memcpy_gbps"],
        gbps_min=min(r["gbps"] for r in rows),
        gbps_max=max(r["gbps"] for r in rows),
        repeats=rows,
    )


def control_overhead(
    workdir: Path, count: int, window: int, engines: Sequence[int] = (1, 4)
) -> dict[str, Any]:
    """Buckets per second with tiny buckets: the per-bucket cost of FSM, acks and relays,
    for each engine count (best of 3 pushes), with every process's CPU per bucket."""
    from engines.sink import random_weights, write_spec
    from examples.launch import Cluster
    from messages.schema import ParamSpec

    spec = [ParamSpec(f"t.{i}", "float32", (16,)) for i in range(count)]
    spec_dir = write_spec(workdir / "tiny-spec", spec)
    weights = list(random_weights(spec, seed=1))
    points = []
    for n in engines:
        with (
            Cluster(
                workdir / f"control-{n}",
                spec_dir,
                engines=n,
                backend="sink",
                daemon_args=["--log-level", "warning"],
                engine_args=["--log-level", "warning"],
            ) as cluster,
            cluster.client(timeout=60.0) as client,
        ):
            pids = {p.name: p.popen.pid for p in cluster.procs}
            best = None
            for v in (1, 2, 3):
                with cpu_used(pids) as cpu:
                    r = client.push(weights, v, bucket_bytes=64, window=window, transport="inline")
                if best is None or r.seconds < best[0].seconds:
                    best = (r, cpu)
        r, cpu = best
        points.append(
            {
                "engines": n,
                "buckets": r.buckets,
                "seconds": r.seconds,
                "buckets_per_s": r.buckets / r.seconds,
                "cpu_us_per_bucket": {k: v / r.buckets * 1e6 for k, v in cpu.items()},
            }
        )
    return {"buckets": count, "window": window, "points": points}


def plot(runs: list[Run], path: Path, baselines: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r.transport, r.bucket_bytes) for r in runs})
    for transport, bucket in keys:
        pts = sorted(
            (r.engines, r.gbps) for r in runs if (r.transport, r.bucket_bytes) == (transport, bucket)
        )
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=f"{transport}, {bucket // MiB} MiB buckets",
        )
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

    t = Table(
        title=f"baselines: raw ZeroMQ {baselines['zmq_gbps']:.2f} GB/s, "
        f"memcpy {baselines['memcpy_gbps']:.2f} GB/s",
        title_justify="left",
    )
    for col in (
        "transport",
        "engines",
        "bucket MiB",
        "GB/s",
        "x zmq",
        "x memcpy",
        "sync s",
        "daemon peak MiB",
        "trainer +MiB",
    ):
        t.add_column(col, justify="right")
    for r in runs:
        t.add_row(
            r.chosen_transport,
            str(r.engines),
            str(r.bucket_bytes // MiB),
            f"{r.gbps:.2f}",
            f"{r.ratio_zmq:.2f}",
            f"{r.ratio_memcpy:.2f}",
            f"{r.seconds:.3f}",
            f"{r.orchestrator_rss_mib:.0f}",
            f"{r.trainer_rss_mib:.0f}",
        )
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(t)
    for p in (control or {}).get("points", []):
        cpu = p["cpu_us_per_bucket"]
        engines = [v for k, v in cpu.items() if k.startswith("engine")]
        console.print(
            f"control overhead: {p['buckets']} tiny buckets in {p['seconds']:.3f}s = "
            f"{p['buckets_per_s']:.0f} buckets/s (window {control['window']}, "
            f"{p['engines']} engine(s)); CPU per bucket: trainer {cpu['trainer']:.0f} us, "
            f"daemon {cpu['daemon']:.0f} us, each engine {statistics.mean(engines):.0f} us, "
            f"all {sum(cpu.values()):.0f} us on {os.cpu_count()} cores"
        )
    return console.export_text()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model-bytes", default="1GiB", help="model size, e.g. 1GiB, 4GiB")
    ap.add_argument("--tensor-bytes", default="16MiB", help="size of each model tensor")
    ap.add_argument("--engines", default="1,2,4", help="engine counts, comma-separated")
    ap.add_argument("--transports", default="inline,shm")
    ap.add_argument("--bucket-bytes", default="16MiB,64MiB", help="bucket sizes, comma-separated")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="syncs per point after a warm-up, each right after a baseline round; medians count",
    )
    ap.add_argument(
        "--control-buckets",
        type=int,
        default=5000,
        help="tiny buckets for the control-overhead run (0 skips it)",
    )
    ap.add_argument("--control-window", type=int, default=32)
    ap.add_argument("--control-engines", default="1,4", help="engine counts for the control run")
    ap.add_argument(
        "--collective-engines",
        default="1,2,4",
        help="engine counts for the collective-vs-raw-broadcast run ('' skips it)",
    )
    ap.add_argument("--collective-repeats", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed, naming each one")
    ap.add_argument("--json", type=Path, default=Path("bench-out/throughput.json"))
    ap.add_argument("--plot", type=Path, default=Path("bench-out/throughput.png"))
    ap.add_argument(
        "--sources",
        default="",
        help="a sharded push instead: wall per sync with these source counts (e.g. 1,2,4), each a "
        "trainer process, same bytes, per transport, into --source-engines sink engines",
    )
    ap.add_argument("--source-engines", type=int, default=2)
    args = ap.parse_args(argv)
    if args.sources:
        return sources_main(args)

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
        print(
            f"model: {len(weights)} tensors, {model_bytes / GiB:.2f} GiB "
            f"(made in {time.perf_counter() - t0:.1f}s); buckets {[b // MiB for b in buckets]} MiB, "
            f"window {args.window}"
        )
        ref_bucket = statistics.median_low(buckets)
        baselines = {
            "zmq_gbps": zmq_gbps(work, weights, ref_bucket),
            "memcpy_gbps": memcpy_gbps(weights),
            "bucket_bytes": ref_bucket,
        }
        print(
            f"baselines over the model's {model_bytes / GiB:.2f} GiB, {ref_bucket // MiB} MiB messages: "
            f"raw ZeroMQ {baselines['zmq_gbps']:.2f} GB/s, memcpy {baselines['memcpy_gbps']:.2f} GB/s"
        )
        runs = sweep(
            work,
            spec_dir,
            weights,
            model_bytes,
            engines,
            transports,
            buckets,
            args.window,
            args.repeats,
            baselines,
        )
        coll_engines = [int(x) for x in args.collective_engines.split(",") if x]
        collective = None
        if coll_engines:
            from bench.collective import run as run_collective

            collective = run_collective(
                work,
                spec_dir,
                weights,
                model_bytes,
                coll_engines,
                ref_bucket,
                args.window,
                args.collective_repeats,
            )
        del weights
        control = (
            control_overhead(
                work,
                args.control_buckets,
                args.control_window,
                [int(x) for x in args.control_engines.split(",") if x],
            )
            if args.control_buckets
            else None
        )
    print(table(runs, baselines, control))
    if collective is not None:
        from bench.collective import table as collective_table

        print(collective_table(collective))
    result = {
        "baselines": baselines,
        "runs": [asdict(r) for r in runs],
        "control": control,
        "collective": collective,
        "machine": machine(),
        "window": args.window,
        "repeats": args.repeats,
    }
    result["missed"] = missed_targets(result)
    for m in result["missed"]:
        print(f"MISSED: {m}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    if args.plot and runs:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, args.plot, baselines)
        print(f"wrote {args.plot}")
    if args.check and result["missed"]:
        raise SystemExit(1)
    return result


def sources_main(args: argparse.Namespace) -> dict[str, Any]:
    """`python -m bench --sources 1,2,4` (bench/sharded.py)."""
    from bench.sharded import run, table
    from engines.sink import synthetic_spec, write_spec
    from messages.dtypes import ITEMSIZE

    model_bytes = parse_size(args.model_bytes)
    bucket = _sizes(args.bucket_bytes)[0]
    sources = [int(x) for x in args.sources.split(",") if x]
    transports = [x for x in args.transports.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        work = Path(tmp)
        spec = synthetic_spec(model_bytes, parse_size(args.tensor_bytes))
        model_bytes = sum(math.prod(p.shape) * ITEMSIZE[p.dtype] for p in spec)
        spec_dir = write_spec(work / "spec", spec)
        print(
            f"sharded push: {len(spec)} tensors, {model_bytes / GiB:.2f} GiB, sources {sources}, "
            f"{args.source_engines} sink engines, bucket {bucket // MiB} MiB, window {args.window}"
        )
        result = run(
            work,
            spec_dir,
            model_bytes,
            sources,
            args.source_engines,
            transports,
            bucket,
            args.window,
            args.repeats,
        )
    print(table(result))
    result["machine"] = machine()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


def missed_targets(result: dict[str, Any]) -> list[str]:
    """Each target this run's figures miss, as a line naming it and the measured value."""
    out = []
    for r in result["runs"]:
        where = f"{r['chosen_transport']} engines={r['engines']} bucket={r['bucket_bytes'] // MiB}MiB"
        if r["transport"] == "inline" and r["ratio_zmq"] < 0.8:
            out.append(f"inline >= 0.8x raw ZeroMQ: {r['ratio_zmq']:.2f}x ({where})")
        if r["transport"] == "shm" and r["ratio_memcpy"] < 0.5:
            out.append(f"shm >= 0.5x memcpy: {r['ratio_memcpy']:.2f}x ({where})")
        limit = 100 + result["window"] * r["bucket_bytes"] / MiB
        if r["orchestrator_rss_mib"] > limit:
            out.append(
                f"daemon RSS <= 100 MiB + window x bucket ({limit:.0f} MiB): "
                f"{r['orchestrator_rss_mib']:.0f} MiB ({where})"
            )
    by = {(r["transport"], r["engines"], r["bucket_bytes"], r["model_bytes"]): r for r in result["runs"]}
    for (t, n, b, m), r in sorted(by.items()):
        where = f"bucket={b // MiB}MiB model={m / GiB:.2f}GiB"
        if t != "shm" or n != 1:
            continue
        inline = by.get(("inline", 1, b, m))
        if inline is not None and r["gbps"] < 2 * inline["gbps"]:
            out.append(f"shm >= 2x inline (1 engine): {r['gbps'] / inline['gbps']:.2f}x ({where})")
        four = by.get(("shm", 4, b, m))
        if four is not None and four["seconds"] > 1.5 * r["seconds"]:
            out.append(
                f"shm 4 engines <= 1.5x the 1-engine time: {four['seconds'] / r['seconds']:.2f}x ({where})"
            )
    sizes = sorted({r["model_bytes"] for r in result["runs"]})
    if len(sizes) > 1:  # the trainer's RSS must not grow with the model it pushes
        for (t, n, b, m), r in sorted(by.items()):
            small = by.get((t, n, b, sizes[0]))
            if m == sizes[-1] and small is not None and r["trainer_rss_mib"] > small["trainer_rss_mib"] + 16:
                out.append(
                    f"trainer RSS flat in model size: +{r['trainer_rss_mib']:.0f} MiB at {m / GiB:.2f}GiB vs "
                    f"+{small['trainer_rss_mib']:.0f} MiB at {sizes[0] / GiB:.2f}GiB ({t} engines={n} bucket={b // MiB}MiB)"
                )
    for p in (result.get("control") or {}).get("points", []):
        if p["buckets_per_s"] < 5000:
            out.append(f">= 5,000 control buckets/s: {p['buckets_per_s']:.0f}/s (engines={p['engines']})")
    coll = result.get("collective")
    if coll:
        for p in coll["points"]:
            if p["ratio_vs_raw"] < 0.9:
                out.append(
                    f"collective >= 0.9x raw broadcast: {p['ratio_vs_raw']:.2f}x (engines={p['engines']})"
                )
            if p["daemon_bytes_received"]:
                out.append(
                    f"no weight bytes through the daemon: {p['daemon_bytes_received']} "
                    f"(engines={p['engines']})"
                )
        four = coll["wall_vs_one_engine"].get(4)
        if four is not None and four > 1.2:
            out.append(f"collective 4 engines <= 1.2x one engine: {four:.2f}x")
    return out


if __name__ == "__main__":
    main()
