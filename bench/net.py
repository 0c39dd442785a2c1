"""`python -m bench.net`: syncs across hosts on the lab (tests/lab: network namespaces on
one bridge, each host's link shaped both ways), each beside its link limit.

The daemon, the trainer and each engine run on a host of their own (`tests.lab.fleet`).
The link limit of a sync is the bytes the busiest link must carry divided by its rate:
- inline (frames through the daemon): the daemon's link carries one copy per engine, so
  N engines cost N copies over it;
- collective (the trainer broadcasts over a torch.distributed group): the physical limit
  is one copy over the trainer's link (a relay or a pipeline through the engines reaches
  it); a star broadcast, the trainer sending each engine its copy, costs N copies.
Each row reports the median push seconds (first begin to READY, `SyncResult.seconds`) of
`--repeats` pushes after a warm-up, the limit of one copy over one link, the limit of the
transport's own layout (N copies over the daemon's link for inline), and their ratios.
A delta push of a small step (50 elements of 3 tensors changed) against a dense push of
every element, one engine behind a `--delta-mbit` link, is the last row.

Sharded rows: `--sources` trainer hosts (each `tests.lab.agent`, source k of n pushing
the tensors k, k+n, ... in name order) push one version into `--source-engines` engines;
the limit is the engines' ingress (each engine takes one whole copy over its own link).

`--check` judges (exit 1 naming each miss): 1 engine, any transport: <= 1.25x the limit
of one copy; 4 engines over the collective: <= 1.5x one copy over the trainer's link; the
delta push: <= 0.3x the dense push's time; 4 sources into 2 engines: <= 1.3x the
engines' ingress limit. Needs root (namespaces); the model is the
"small" tiny Llama (~31 MB fp32) unless `--size` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ONE_ENGINE_TARGET = 1.25  # x the limit of one copy over one link
COLLECTIVE_4_TARGET = 1.5  # x one copy over the trainer's link, 4 engines
DELTA_TARGET = 0.3  # x the dense push's time
SOURCES_4_TARGET = 1.3  # x the engines' ingress limit (one copy over an engine's link)


def _fleet_rows(
    model_dir: Path,
    work: Path,
    transport: str,
    engines: int,
    mbit: float,
    repeats: int,
    bucket_bytes: int,
    model_bytes: int,
) -> dict[str, Any]:
    from tests.lab.fleet import LabFleet
    from tests.lab.net import Lab

    with Lab(rate_mbit=mbit) as lab, LabFleet(lab, work, model_dir, engines=engines) as f:
        seconds = []
        for v in range(1, repeats + 2):
            r = f.push(v, transport=transport, bucket_bytes=bucket_bytes, timeout=600)
            if not r["ok"] or r["result"]["detail"].get("transport") != transport:
                raise RuntimeError(f"{transport} x{engines}: push {v} failed: {r}")
            if v > 1:  # the first push warms up (connections, the group, the spool)
                seconds.append(float(r["result"]["seconds"]))
    one_copy = model_bytes * 8 / (mbit * 1e6)
    copies = engines if transport == "inline" else 1
    s = statistics.median(seconds)
    return {
        "transport": transport,
        "engines": engines,
        "mbit": mbit,
        "model_bytes": model_bytes,
        "seconds": s,
        "all_seconds": seconds,
        "one_copy_limit_s": one_copy,
        "layout_limit_s": one_copy * copies,
        "vs_one_copy": s / one_copy,
        "vs_layout": s / (one_copy * copies),
    }


def _sources_row(
    model_dir: Path,
    work: Path,
    transport: str,
    sources: int,
    engines: int,
    mbit: float,
    repeats: int,
    bucket_bytes: int,
    model_bytes: int,
) -> dict[str, Any]:
    """`sources` trainer hosts push one version into `engines` engines: the median of the
    slowest source's seconds (the sync's), beside the engines' ingress limit."""
    from tests.lab.fleet import LabFleet
    from tests.lab.net import Lab

    with (
        Lab(rate_mbit=mbit) as lab,
        LabFleet(lab, work, model_dir, engines=engines, sources=sources) as f,
    ):
        seconds = []
        for v in range(1, repeats + 2):
            answers = f.push_sharded(v, transport=transport, bucket_bytes=bucket_bytes, timeout=600)
            bad = [a for a in answers if not a["ok"] or a["result"]["detail"].get("transport") != transport]
            if bad:
                raise RuntimeError(f"{transport} {sources} sources x{engines}: push {v} failed: {bad}")
            if v > 1:
                seconds.append(max(float(a["result"]["seconds"]) for a in answers))
    ingress = model_bytes * 8 / (mbit * 1e6)  # each engine takes one whole copy over its link
    s = statistics.median(seconds)
    return {
        "transport": transport,
        "sources": sources,
        "engines": engines,
        "mbit": mbit,
        "model_bytes": model_bytes,
        "seconds": s,
        "all_seconds": seconds,
        "ingress_limit_s": ingress,
        "vs_ingress": s / ingress,
    }


def _delta_row(model_dir: Path, work: Path, mbit: float, repeats: int, bucket_bytes: int) -> dict[str, Any]:
    from tests.lab.fleet import LabFleet
    from tests.lab.net import Lab

    with (
        Lab(rate_mbit=mbit) as lab,
        LabFleet(lab, work, model_dir, engines=1, engine_args=["--delta-base"]) as f,
    ):
        dense, delta, sent = [], [], []
        v = 0
        for _ in range(repeats + 1):
            v += 1
            d = f.push(
                v, transport="inline", bucket_bytes=bucket_bytes, timeout=600, client="delta", delta=True
            )
            v += 1
            p = f.push(
                v,
                transport="inline",
                bucket_bytes=bucket_bytes,
                timeout=600,
                client="delta",
                delta=True,
                change="sparse",
            )
            if not (d["ok"] and p["ok"]):
                raise RuntimeError(f"delta run failed: {d} {p}")
            if v > 2:  # the first pair warms up (and the first delta push goes dense)
                dense.append(float(d["result"]["seconds"]))
                delta.append(float(p["result"]["seconds"]))
                sent.append(p["result"]["detail"].get("delta"))
    return {
        "transport": "inline",
        "engines": 1,
        "mbit": mbit,
        "dense_s": statistics.median(dense),
        "delta_s": statistics.median(delta),
        "ratio": statistics.median(delta) / statistics.median(dense),
        "delta_detail": sent[-1] if sent else None,
    }


def check(
    rows: list[dict[str, Any]], delta: dict[str, Any] | None, sharded: list[dict[str, Any]] | None = None
) -> list[str]:
    missed = []
    for r in sharded or ():
        if r["sources"] == 4 and r["engines"] == 2 and r["vs_ingress"] > SOURCES_4_TARGET:
            missed.append(
                f"{r['transport']} 4 sources x2: {r['seconds']:.2f}s = {r['vs_ingress']:.2f}x the engines' "
                f"ingress limit (target <= {SOURCES_4_TARGET})"
            )
    for r in rows:
        if r["engines"] == 1 and r["vs_one_copy"] > ONE_ENGINE_TARGET:
            missed.append(
                f"{r['transport']} x1: {r['seconds']:.2f}s = {r['vs_one_copy']:.2f}x one copy's limit "
                f"(target <= {ONE_ENGINE_TARGET})"
            )
        if r["engines"] == 4 and r["transport"] == "collective" and r["vs_one_copy"] > COLLECTIVE_4_TARGET:
            missed.append(
                f"collective x4: {r['seconds']:.2f}s = {r['vs_one_copy']:.2f}x one copy over the "
                f"trainer's link (target <= {COLLECTIVE_4_TARGET})"
            )
    if delta is not None and delta["ratio"] > DELTA_TARGET:
        missed.append(
            f"delta at {delta['mbit']} Mbit/s: {delta['ratio']:.2f}x the dense push (target <= {DELTA_TARGET})"
        )
    return missed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", help="examples.tiny model size")
    ap.add_argument("--mbit", type=float, default=200.0, help="every link's rate")
    ap.add_argument("--engines", default="1,2,4")
    ap.add_argument("--transports", default="inline,collective")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=4 << 20)
    ap.add_argument("--sources", default="1,2,4", help="sharded rows: source hosts ('' for none)")
    ap.add_argument("--source-engines", type=int, default=2)
    ap.add_argument("--source-transports", default="collective")
    ap.add_argument("--delta-mbit", type=float, default=100.0, help="0: no delta row")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)

    from examples.tiny import build_tiny_llama
    from tests.lab.net import unavailable

    why = unavailable()
    if why is not None:
        print(f"bench.net: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-net-"))
    model_dir = build_tiny_llama(tmp / "model", size=args.size, seed=0)
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    rows = []
    for transport in (t for t in args.transports.split(",") if t):
        for n in (int(x) for x in args.engines.split(",") if x):
            r = _fleet_rows(
                model_dir,
                tmp / f"{transport}-{n}",
                transport,
                n,
                args.mbit,
                args.repeats,
                args.bucket_bytes,
                model_bytes,
            )
            rows.append(r)
            print(
                f"{transport:10s} x{n}: {r['seconds']:6.2f}s  one copy {r['one_copy_limit_s']:.2f}s "
                f"({r['vs_one_copy']:.2f}x)  its layout {r['layout_limit_s']:.2f}s ({r['vs_layout']:.2f}x)",
                flush=True,
            )
    sharded = []
    for transport in (t for t in args.source_transports.split(",") if t):
        for k in (int(x) for x in args.sources.split(",") if x):
            r = _sources_row(
                model_dir,
                tmp / f"{transport}-sources-{k}",
                transport,
                k,
                args.source_engines,
                args.mbit,
                args.repeats,
                args.bucket_bytes,
                model_bytes,
            )
            sharded.append(r)
            print(
                f"{transport:10s} {k} source(s) x{args.source_engines}: {r['seconds']:6.2f}s  engines' ingress "
                f"{r['ingress_limit_s']:.2f}s ({r['vs_ingress']:.2f}x)",
                flush=True,
            )
    delta = None
    if args.delta_mbit > 0:
        delta = _delta_row(model_dir, tmp / "delta", args.delta_mbit, args.repeats, args.bucket_bytes)
        print(
            f"delta at {args.delta_mbit:.0f} Mbit/s: dense {delta['dense_s']:.2f}s, delta {delta['delta_s']:.2f}s "
            f"= {delta['ratio']:.2f}x",
            flush=True,
        )
    out = {"model_bytes": model_bytes, "size": args.size, "rows": rows, "sharded": sharded, "delta": delta}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2))
    if args.check:
        missed = check(rows, delta, sharded)
        for m in missed:
            print(f"MISSED: {m}")
        return 1 if missed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
