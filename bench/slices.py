"""`python -m bench.slices`: what each engine rank is handed when the sender cuts slices.

A bf16 Llama-shaped model (`--hidden`, `--layers`, `--vocab`; split dimensions divisible
by every `--tp`) is pushed through a real daemon to one torch engine per tensor-parallel
size in `--tp` (`weightsync engine --tp N`: N ranks of vLLM's Llama partition, which take
slices), over `--transport`. The baseline, measured in the same run, is the same push to
an engine of one rank (every tensor whole). Per size, the median of `--repeats` pushes:
the bytes each rank was handed (the engine's own count, in status: `slices.received`),
the largest rank's over the whole model's bytes, the bytes on the wire, and push seconds.
`--check` exits 1 naming each missed target: largest rank / whole <= 0.6 at tp 2 and
<= 0.35 at tp 4.

Not measured here: the lab row (each rank behind its own link). The ranks of a torch
engine share its process and its one link, so a sync's seconds say nothing of per-rank
links yet; the row is reported "not run".
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

from bench.common import build_llama, machine

TARGETS = {2: 0.6, 4: 0.35}  # the largest rank's bytes / the whole model's


def build(path: Path, hidden: int, layers: int, vocab: int) -> Any:
    # 4 KV heads (>= the largest tp): each rank keeps whole heads, as vLLM's split does
    return build_llama(path, hidden, layers, vocab, heads=max(4, hidden // 64), kv_heads=4, mlp=hidden * 3)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from examples.launch import Cluster

    with tempfile.TemporaryDirectory(prefix="ws-bench-slices-") as tmp:
        work = Path(tmp)
        model = build(work / "model", args.hidden, args.layers, args.vocab)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        whole = sum(t.numel() * t.element_size() for t in state.values())
        rows: dict[int, dict[str, Any]] = {}
        for tp in [1, *[t for t in args.tp if t != 1]]:
            cluster = Cluster(
                work / f"cluster-{tp}",
                work / "model",
                engines=1,
                daemon_args=["--engine-timeout", "30"],
                engine_args=["--threads", "1", "--tp", str(tp)],
            )
            pushes = []
            with cluster, cluster.client(timeout=120.0) as client:
                for v in range(1, args.repeats + 1):
                    weights = [(k, t + 0.001 * v) for k, t in state.items()]
                    t0 = time.perf_counter()
                    r = client.push(weights, v, transport=args.transport)
                    seconds = time.perf_counter() - t0
                    if r.state != "READY":
                        raise SystemExit(f"tp {tp}: push of version {v} ended {r.state}")
                    (e,) = client.status()["engines"]
                    received = e["slices"]["received"] if "slices" in e else [whole]
                    pushes.append({"seconds": seconds, "wire_bytes": r.bytes, "received": received})
                    del weights
            received = pushes[-1]["received"]
            rows[tp] = {
                "ranks": len(received),
                "received": received,
                "largest_rank_over_whole": max(received) / whole,
                "wire_bytes": statistics.median(p["wire_bytes"] for p in pushes),
                "seconds": statistics.median(p["seconds"] for p in pushes),
            }
    for row in rows.values():
        row["seconds_over_whole"] = row["seconds"] / rows[1]["seconds"]
    return {"whole_bytes": whole, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.slices", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--transport", default="inline")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--check", action="store_true", help="exit 1 naming every missed target")
    args = ap.parse_args(argv)
    out = measure(args)
    whole = out["whole_bytes"]
    print(f"model: {whole / 1e6:.1f} MB bf16, transport {args.transport}, median of {args.repeats} pushes")
    print(
        f"{'tp':>3} {'bytes per rank (MB)':<34} {'largest/whole':>13} {'wire MB':>8} {'push s':>7} {'x tp1':>6}"
    )
    missed = []
    for tp, row in out["rows"].items():
        per = ", ".join(f"{b / 1e6:.1f}" for b in row["received"])
        print(
            f"{tp:>3} {per:<34} {row['largest_rank_over_whole']:>13.3f} {row['wire_bytes'] / 1e6:>8.1f} "
            f"{row['seconds']:>7.2f} {row['seconds_over_whole']:>6.2f}"
        )
        target = TARGETS.get(tp)
        if target is not None and row["largest_rank_over_whole"] > target:
            missed.append(
                f"tp {tp}: largest rank {row['largest_rank_over_whole']:.3f} of the model > {target}"
            )
    for tp in TARGETS:
        if tp not in out["rows"]:
            missed.append(f"tp {tp}: not run")
    print(
        "lab (each rank behind its own link, sync seconds at tp 2 vs whole): not run: a torch engine's ranks share its process and link"
    )
    out["lab"] = "not run"
    out["missed"] = missed
    out["machine"] = machine()
    for m in missed:
        print(f"MISSED: {m}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 1 if (missed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
