"""`python -m bench.delta`: delta sync against dense, after a real optimizer step.

A bf16 Llama (`--hidden`, `--layers`, `--vocab`; the default is ~470 MB) trains in this
process (the trainer) with AdamW at `--lr` on random tokens; after each step the weights
go to one torch engine (`--delta-base`) through a real daemon, over each of
`--transports`. Per repeat and transport, interleaved: a step, then a dense push (the
baseline, measured in the same run); a step, then a delta push against it. Reported,
medians of `--repeats`: wire bytes and push wall seconds (first begin to READY) of each,
and their ratios; the transports' order turns every repeat. A delta push sends dense
where the client measured delta slower than dense on that transport (`delta chosen`
says how many went as deltas): its time counts as measured, its bytes and density come
from the pushes that went as deltas (a push sent dense has density 1: every element).
Then, on inline: a step that changes every element (dense-every-element: the client must
fall back to dense at about the cost of a dense push), and a sweep of
densities (a fraction of every tensor's elements changed) showing where delta stops
paying. The memory the base copy costs is the model's bytes, on the trainer
(`DeltaBase.nbytes`) and on each engine (its RSS is reported). `--check` exits 1 naming
each missed target: bytes on every transport, time on inline and collective (0.6x) and on
every transport (1.2x), the every-element fallback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import build_llama

BYTES_TARGET = 0.2  # delta wire bytes / dense, after one step
TIME_TARGET = 0.6  # delta push seconds / dense, on inline and collective
MAX_TIME_RATIO = 1.2  # delta push seconds / dense, on every transport (never much worse)
DENSE_FALLBACK_TARGET = 1.1  # delta push of an every-element change / dense push
DENSITIES = (0.001, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5)


def summarize(rows: list[dict[str, Any]], transports: list[str]) -> dict[str, Any]:
    """Per transport, medians over its rows (a delta push against the dense push before
    it). Time counts every delta push as chosen (a push sent dense is what a user waits
    for); bytes and density count only the pushes that went as deltas (a push sent dense
    changed every element it sent: its density says nothing of the step). No delta push:
    bytes from all (the first push of a run always goes delta), density None."""
    summary: dict[str, Any] = {}
    for t in transports:
        mine = [r for r in rows if r["transport"] == t]
        deltas = [r for r in mine if r["chose"] == "delta"]
        encoded = deltas or mine
        dense_s = statistics.median(r["dense_s"] for r in mine)
        delta_s = statistics.median(r["delta_s"] for r in mine)  # as chosen: the product's cost
        dense_b = statistics.median(r["dense_bytes"] for r in encoded)
        delta_b = statistics.median(r["delta_bytes"] for r in encoded)  # what a delta sends
        summary[t] = {
            "delta_chosen": len(deltas),
            "pushes": len(mine),
            "dense_s": dense_s,
            "delta_s": delta_s,
            "time_ratio": delta_s / dense_s,
            "dense_bytes": dense_b,
            "delta_bytes": delta_b,
            "bytes_ratio": delta_b / dense_b,
            "density": statistics.median(r["density"] for r in deltas) if deltas else None,
        }
    return summary


def build(path: Path, hidden: int, layers: int, vocab: int) -> Any:
    heads = max(1, hidden // 128)
    return build_llama(
        path,
        hidden,
        layers,
        vocab,
        heads=heads,
        kv_heads=max(1, heads // 4),
        mlp=int(hidden * 2.75) // 64 * 64,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.delta", description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--transports", default="inline,shm,collective")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--densities", default=",".join(str(d) for d in DENSITIES))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from bench.common import machine, rss_mib
    from examples.launch import Cluster

    transports = [t for t in args.transports.split(",") if t]
    densities = [float(d) for d in args.densities.split(",") if d]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ws-bench-delta-") as tmp:
        work = Path(tmp)
        model = build(work / "model", args.hidden, args.layers, args.vocab)
        params = [p for p in model.parameters()]
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        opt = torch.optim.AdamW(params, lr=args.lr)
        gen = torch.Generator().manual_seed(1)

        def train_step() -> None:
            ids = torch.randint(4, args.vocab, (1, 32), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def weights() -> list[tuple[str, Any]]:
            return list(model.state_dict().items())

        cluster = Cluster(
            work / "cluster",
            work / "model",
            engines=1,
            daemon_args=["--engine-timeout", "30"],
            engine_args=["--threads", "1", "--delta-base"],
        )
        rows: list[dict[str, Any]] = []
        version = 0
        with cluster, cluster.client(timeout=120.0) as client:
            engine_pid = next(p.popen.pid for p in cluster.procs if p.name == "engine-0")

            phases: dict[tuple[str, str], list[dict[str, float]]] = {}

            def push(delta: bool, transport: str, main: bool = False) -> tuple[float, int, dict[str, Any]]:
                nonlocal version
                version += 1
                t0 = time.perf_counter()
                r = client.push(weights(), version, delta=delta, transport=transport)
                seconds = time.perf_counter() - t0
                if r.state != "READY":
                    raise SystemExit(f"push of version {version} ended {r.state}")
                if not delta:  # the next delta is against this version, as a trainer's would be
                    client.delta_base.adopt(weights(), version)
                where = {
                    **{f"trainer_{k}": v for k, v in r.detail["trainer_phases"].items()},
                    **{f"engine_{k}": v for k, v in r.engines[0].get("phases", {}).items()},
                }
                if main:  # the per-transport rows (not the fallback or the sweep)
                    phases.setdefault(("delta" if delta else "dense", transport), []).append(where)
                return seconds, r.bytes, r.detail.get("delta", {})

            push(True, "inline")  # warm-up; the first delta push is dense and keeps the copy
            for rep in range(args.repeats):
                # the order turns every repeat: no transport always follows the same one
                # (a dense push right after another transport's delta push ran slower)
                k = rep % len(transports)
                for t in transports[k:] + transports[:k]:
                    train_step()
                    ds, db, _ = push(False, t, main=True)
                    train_step()
                    xs, xb, d = push(True, t, main=True)
                    if d.get("base") is None and d.get("chose") != "dense":
                        raise SystemExit(f"delta push on {t} went dense: {d}")
                    rows.append(
                        {
                            "transport": t,
                            "repeat": rep,
                            "dense_s": ds,
                            "dense_bytes": db,
                            "delta_s": xs,
                            "delta_bytes": xb,
                            "density": d["density"],
                            "kinds": d["tensors"],
                            "chose": d["chose"],
                            "why": d["why"],
                        }
                    )
                    print(
                        f"{t:>10} rep {rep}: dense {ds:.3f}s {db / 1e6:.1f} MB | delta {xs:.3f}s "
                        f"{xb / 1e6:.2f} MB density {d['density']:.4f} {d['tensors']} (chose {d['chose']})",
                        flush=True,
                    )

            # every element changes: the client must fall back to dense, at a dense push's cost.
            # Here and in the sweep each delta push is tried as one (the chooser forgets what
            # it measured): they measure the encoding at a density, not the choice.
            every: list[tuple[float, float]] = []
            for _ in range(args.repeats):
                with torch.no_grad():
                    for p in params:
                        p.add_(torch.full_like(p, 0.01))
                ds, _, _ = push(False, "inline")
                with torch.no_grad():
                    for p in params:
                        p.add_(torch.full_like(p, 0.01))
                client.delta_chooser.paces.clear()
                xs, _, d = push(True, "inline")
                every.append((ds, xs))
                print(f"every element changed: dense {ds:.3f}s | delta {xs:.3f}s {d['tensors']}", flush=True)
            # the density sweep: where delta stops paying (bytes and time against dense)
            sweep: list[dict[str, Any]] = []
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
            for dens in densities:
                ds, db, _ = push(False, "inline")
                with torch.no_grad():
                    for p in params:
                        flat = p.view(ints[p.element_size()]).view(-1)
                        k = int(flat.numel() * dens)
                        idx = torch.randperm(flat.numel(), generator=gen)[:k]
                        flat[idx] ^= 1
                client.delta_chooser.paces.clear()
                xs, xb, d = push(True, "inline")
                sweep.append(
                    {
                        "density": dens,
                        "bytes_ratio": xb / db,
                        "time_ratio": xs / ds,
                        "kinds": d["tensors"],
                    }
                )
                print(
                    f"density {dens:>6}: bytes {xb / db:.3f}x, time {xs / ds:.3f}x {d['tensors']}",
                    flush=True,
                )
            base_bytes = client.delta_base.nbytes
            engine_rss = rss_mib(engine_pid)

    summary = summarize(rows, transports)
    every_ratio = statistics.median(x / d for d, x in every)
    where_time = {
        f"{kind} {t}": {
            k: statistics.median(p.get(k, 0.0) for p in ps) for k in sorted({k for p in ps for k in p})
        }
        for (kind, t), ps in phases.items()
        if t in transports
    }
    breakeven = next((s["density"] for s in sweep if s["time_ratio"] >= 1.0), None)
    missed = []
    for t, s in summary.items():
        if s["bytes_ratio"] > BYTES_TARGET:
            missed.append(f"{t}: delta bytes {s['bytes_ratio']:.3f}x dense > {BYTES_TARGET}")
        if t in ("inline", "collective") and s["time_ratio"] > TIME_TARGET:
            missed.append(f"{t}: delta push {s['time_ratio']:.3f}x dense > {TIME_TARGET}")
        if s["time_ratio"] > MAX_TIME_RATIO:
            missed.append(
                f"{t}: delta push {s['time_ratio']:.3f}x dense > {MAX_TIME_RATIO} (every transport)"
            )
    if every_ratio > DENSE_FALLBACK_TARGET:
        missed.append(f"every element changed: delta push {every_ratio:.3f}x dense > {DENSE_FALLBACK_TARGET}")
    out = {
        "model_bytes": model_bytes,
        "lr": args.lr,
        "repeats": args.repeats,
        "summary": summary,
        "runs": rows,
        "every_element_ratio": every_ratio,
        "every_element_runs": [{"dense_s": d, "delta_s": x} for d, x in every],
        "phases": where_time,
        "sweep": sweep,
        "time_breakeven_density": breakeven,
        "base_bytes": base_bytes,
        "engine_rss_mib": engine_rss,
        "missed": missed,
        "machine": machine(),
    }
    print(f"\nmodel {model_bytes / 1e6:.0f} MB bf16, AdamW lr {args.lr}, medians of {args.repeats}")
    print(
        f"{'transport':>10} {'dense s':>8} {'delta s':>8} {'time':>7} {'dense MB':>9} {'delta MB':>9} "
        f"{'bytes':>7} {'density':>8} {'delta chosen':>12}"
    )
    for t, s in summary.items():
        print(
            f"{t:>10} {s['dense_s']:8.3f} {s['delta_s']:8.3f} {s['time_ratio']:6.3f}x "
            f"{s['dense_bytes'] / 1e6:9.1f} {s['delta_bytes'] / 1e6:9.2f} {s['bytes_ratio']:6.3f}x "
            f"{'-' if s['density'] is None else format(s['density'], '8.4f'):>8} "
            f"{s['delta_chosen']:>8}/{s['pushes']}"
        )
    print("where a push's time goes (medians, seconds; the trainer's and the engine's phases overlap):")
    for key, ph in where_time.items():
        print(f"  {key:>16}: " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items() if v >= 0.01))
    print(f"every element changed: delta push {every_ratio:.3f}x a dense push")
    print(
        f"delta stops paying (time) at density {breakeven if breakeven is not None else '> ' + str(densities[-1])}"
    )
    print(
        f"base copy: {base_bytes / 1e6:.0f} MB on the trainer and on each engine (engine RSS {engine_rss:.0f} MiB)"
    )
    for m in missed:
        print(f"MISSED: {m}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    if args.check and missed:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
