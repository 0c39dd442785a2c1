"""`python -m bench.vllm`: the same weights into real vLLM, through weightsync vs direct.

Three ways in, measured in one run, alternating (direct, weightsync per transport, disk,
direct, ...) after one warm-up round, medians of `--repeats`:
- direct: in this process, one `collective_rpc` running vLLM's layerwise reload over the
  same buckets (`initialize_layerwise_reload`, `model.load_weights` per bucket,
  `finalize_layerwise_reload`) with the tensors handed over by reference, then the prefix
  cache reset: the cheapest way these weights can get into vLLM, and the baseline;
- weightsync: a daemon and a vLLM engine process, `TrainerClient.push` over each of
  `--transports` (digest, checksums, finalize once, prefix-cache reset included);
- disk: what a user does without weightsync, `safetensors.save_file` then vLLM's
  `reload_weights(weights_path=...)` on the same in-process LLM.
`--profile` prints where one sync's time goes, per engine and in the trainer (medians
over the repeats; phases overlap: the trainer packs while the engine loads), and the
account of its passes over the model's bytes: for each pass, who reads and writes what,
in which process and thread, its bytes and seconds. With two sizes or more, each pass's
cost is split into a fixed part and a per-MB part (a line through the sizes), and so is
weightsync's overhead above the direct load.
`--check` exits 1 naming each missed target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RATIO_TARGET = 1.3  # weightsync (shm, collective) / direct
INLINE_TARGET = 2.0  # weightsync inline / direct
PER_MB_TARGET = 0.1  # ms of weightsync's overhead above direct, per MB (shm), fitted over sizes


def _direct(llm: Any, buckets: list) -> float:
    def reload(worker: Any) -> bool:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = worker.model_runner.get_model()
        initialize_layerwise_reload(model)
        for tensors in buckets:
            model.load_weights(iter(tensors))
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        return True

    t0 = time.perf_counter()
    llm.collective_rpc(reload)
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def _kept_bytes(llm: Any, buckets: list) -> int:
    """The bytes of the weights vLLM still holds when a bucket's `load_weights` returns,
    over the same buckets (what the engine copies out: engines.vllm.loading
    `keep_pending_weights`), counted in an untimed direct reload."""

    def reload(worker: Any) -> int:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from engines.vllm.loading import pending_weights

        model = worker.model_runner.get_model()
        initialize_layerwise_reload(model)
        kept = 0
        for tensors in buckets:
            model.load_weights(iter(tensors))
            kept += sum(v.numel() * v.element_size() for _, _, v in pending_weights(tensors[0][1]))
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        return kept

    return int(llm.collective_rpc(reload)[0])


def _disk(llm: Any, weights: dict, where: Path) -> float:
    from safetensors.torch import save_file

    where.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    save_file(weights, str(where / "model.safetensors"))
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(where)})
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def _median_phases(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def run_size(
    size: str, tmp: Path, bucket_bytes: int, repeats: int, transports: list[str], disk: bool
) -> dict[str, Any]:
    from bench.common import cpu_used
    from engines.torch_engine import load_model
    from examples.launch import Cluster
    from examples.tiny import build_tiny_llama, perturbed
    from messages.buckets import iter_buckets, unpack
    from orchestrator.daemon.config import set_process_env, vllm_process_env

    model_dir = build_tiny_llama(tmp / f"model-{size}", size=size)
    weights = dict(perturbed(load_model(model_dir).state_dict(), 1))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    buckets = [list(unpack(b.tensors, bytes(b.frame()))) for b in iter_buckets(weights.items(), bucket_bytes)]
    times: dict[str, list[float]] = {"direct": [], "disk": [], **{t: [] for t in transports}}
    profiles: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
    direct_cpu: list[float] = []

    set_process_env(vllm_process_env(False))
    from vllm import LLM

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    version = 0
    with (
        Cluster(tmp / f"cluster-{size}", model_dir, engines=1, backend="vllm") as cluster,
        cluster.client(timeout=300.0) as client,
    ):
        pids = {p.name: p.popen.pid for p in cluster.procs}
        kept_bytes = _kept_bytes(llm, buckets)
        for r in range(repeats + 1):  # round 0 warms every path up and is not counted
            keep = r > 0
            c0 = time.process_time()  # this process: vLLM and its intra-op threads
            d = _direct(llm, buckets)
            if keep:
                times["direct"].append(d)
                direct_cpu.append(time.process_time() - c0)
            for t in transports:
                version += 1
                with cpu_used(pids) as cpu:
                    res = client.push(weights.items(), version, bucket_bytes=bucket_bytes, transport=t)
                if res.detail["transport"] != t:
                    raise SystemExit(f"asked for {t}, the daemon chose {res.detail['transport']}")
                if keep:
                    times[t].append(res.seconds)
                    profiles[t].append(
                        {
                            "seconds": res.seconds,
                            "cpu": cpu,
                            "trainer": res.detail.get("trainer_phases", {}),
                            "engines": {e["engine_id"]: e.get("phases", {}) for e in res.engines},
                            # the bytes each pass went over, as the code doing it counted them
                            "trainer_bytes": res.detail.get("trainer_pass_bytes", {}),
                            "engine_bytes": {e["engine_id"]: e.get("pass_bytes", {}) for e in res.engines},
                        }
                    )
            if disk:
                s = _disk(llm, weights, tmp / f"disk-{size}")
                if keep:
                    times["disk"].append(s)
    if not disk:
        times.pop("disk")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "size": size,
        "model_bytes": nbytes,
        "bucket_bytes": bucket_bytes,
        "repeats": repeats,
        "median_s": med,
        "min_s": {k: min(v) for k, v in times.items()},
        "max_s": {k: max(v) for k, v in times.items()},
        "all_s": times,
        "ratio_vs_direct": {k: med[k] / med["direct"] for k in med},
        "profiles": profiles,
        "direct_cpu_s": statistics.median(direct_cpu),
        "kept_bytes": kept_bytes,
        "cpus": os.cpu_count() or 1,
    }


def _median_bytes(rows: list[dict[str, int]], key: str) -> int | None:
    """The median over the repeats of one pass's counted bytes; None where it was not counted."""
    got = [r[key] for r in rows if key in r]
    return int(statistics.median(got)) if got and len(got) == len(rows) else None


def passes(res: dict[str, Any], transport: str) -> list[dict[str, Any]]:
    """One sync's passes over the model's bytes (medians over the repeats), and the direct
    load's for comparison. `bytes` is what the pass went over: counted by the code that
    does the work (`counted`: the trainer's copy and hash, the engine's hash, vLLM's kept
    weights), or else the model's bytes times the passes the code is written to make
    (`counted` False: the daemon's forward, the collective's receive, vLLM's loaders).
    Seconds are the pass's own time on its thread (`cpu` rows: that process's CPU, every
    thread)."""
    n = res["model_bytes"]
    rows = res["profiles"][transport]
    tr = _median_phases([r["trainer"] for r in rows])
    en = _median_phases([next(iter(r["engines"].values()), {}) for r in rows])
    cpu = _median_phases([r["cpu"] for r in rows])
    tr_bytes = [r.get("trainer_bytes", {}) for r in rows]
    en_bytes = [next(iter(r.get("engine_bytes", {}).values()), {}) for r in rows]
    slot = {"shm": "its shm slot", "inline": "its ring buffer", "collective": "its ring buffer"}[transport]

    def counted(
        name: str, proc: str, thread: str, what: str, nbytes: int | None, s: float
    ) -> tuple[Any, ...]:
        return (name, proc, thread, what, nbytes if nbytes is not None else 0, s, nbytes is not None)

    def nominal(name: str, proc: str, thread: str, what: str, nbytes: int, s: float) -> tuple[Any, ...]:
        return (name, proc, thread, what, nbytes, s, False)

    if "pack_copy" in tr:
        out = [
            counted(
                "trainer: pack",
                "trainer",
                "main",
                f"tensors -> {slot}",
                _median_bytes(tr_bytes, "pack_copy"),
                tr["pack_copy"],
            ),
            counted(
                "trainer: hash",
                "trainer",
                "main",
                f"{slot} -> every tensor's part",
                _median_bytes(tr_bytes, "pack_hash"),
                tr["pack_hash"],
            ),
        ]
    else:  # a trainer that does not time its copy and its hash apart
        out = [
            nominal(
                "trainer: pack+hash", "trainer", "main", f"tensors -> {slot}, hashed", n, tr.get("pack", 0.0)
            )
        ]
    daemon = cpu.get("daemon", 0.0)
    if transport == "inline":
        what = "socket -> frame -> part check -> socket (and the control messages)"
        out.append(nominal("daemon: forward", "daemon", "all (CPU)", what, n, daemon))
    else:
        out.append(
            nominal(
                "daemon: control", "daemon", "all (CPU)", "messages only: no byte of the model", 0, daemon
            )
        )
    if transport == "collective":
        out.append(
            nominal(
                "worker: receive",
                "engine",
                "vLLM worker",
                "group -> receive buffer",
                n,
                en.get("worker_receive", 0.0),
            )
        )
        out.append(
            nominal(
                "worker: hash",
                "engine",
                "vLLM worker",
                "receive buffer -> parts, checked",
                n,
                en.get("worker_checksum", 0.0),
            )
        )
    else:
        out.append(
            counted(
                "engine: hash",
                "engine",
                "verifier",
                "bucket -> parts, checked",
                _median_bytes(en_bytes, "checksum"),
                en.get("checksum", 0.0),
            )
        )
    out.append(
        nominal(
            "vLLM: load",
            "engine",
            "applier (vLLM's loaders)",
            "bucket -> layer buffers -> parameters (2 passes, as in direct)",
            2 * n,
            en.get("vllm_load_weights", 0.0),
        )
    )
    out.append(
        counted(
            "vLLM: keep pending",
            "engine",
            "applier",
            "weights of layers a bucket cut -> copies",
            res["kept_bytes"],
            en.get("vllm_keep_pending", 0.0),
        )
    )
    out.append(
        nominal(
            "direct: load",
            "bench",
            "vLLM's loaders",
            "tensors -> layer buffers -> parameters",
            2 * n,
            res["median_s"]["direct"],
        )
    )
    return [
        dict(
            zip(
                ("pass", "process", "thread", "reads -> writes", "bytes", "seconds", "counted"),
                r,
                strict=True,
            )
        )
        for r in out
    ]


def cpu_floor(res: dict[str, Any], transport: str) -> str:
    """The least wall time one sync's CPU allows on this host's cores, against direct: a
    sync cannot end before all of its processes' CPU seconds are spent."""
    cpu = _median_phases([r["cpu"] for r in res["profiles"][transport]])
    total, cores, direct = sum(cpu.values()), res["cpus"], res["median_s"]["direct"]
    return (
        f"  CPU floor, {transport}: {total * 1e3:.0f} ms of CPU on {cores} cores >= "
        f"{total / cores * 1e3:.0f} ms wall = x{total / cores / direct:.2f} direct "
        f"(direct: {res['direct_cpu_s'] * 1e3:.0f} ms CPU in {direct * 1e3:.0f} ms)"
    )


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line through (MB, seconds): (fixed ms, ms per MB)."""
    if len(points) < 2:
        return float("nan"), float("nan")
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")
    return (my - slope * mx) * 1e3, slope * 1e3


def overhead_fit(results: list[dict[str, Any]], transport: str) -> tuple[float, float]:
    """weightsync's time above the direct load, as fixed ms + ms per MB of the model."""
    return fit(
        [
            (r["model_bytes"] / 1e6, r["median_s"][transport] - r["median_s"]["direct"])
            for r in results
            if transport in r["median_s"]
        ]
    )


def pass_table(res: dict[str, Any], transport: str) -> str:
    lines = [
        f"  passes over the bytes, {transport} ({res['model_bytes'] / 1e6:.1f} MB; medians):",
        f"    {'pass':20s} {'process':8s} {'thread':26s} {'reads -> writes':66s} {'MB':>7s} {'ms':>7s} {'ms/MB':>6s}",
    ]
    for p in passes(res, transport):
        mb = p["bytes"] / 1e6
        mark = " " if p["counted"] else "*"
        lines.append(
            f"    {p['pass']:20s} {p['process']:8s} {p['thread']:26s} {p['reads -> writes']:66s} "
            f"{mb:6.1f}{mark} {p['seconds'] * 1e3:7.1f} {p['seconds'] * 1e3 / mb if mb else 0.0:6.3f}"
        )
    lines.append(
        "    MB counted by the code doing the pass; * the model's bytes times the passes the code makes"
    )
    return "\n".join(lines)


def fit_table(results: list[dict[str, Any]], transports: list[str]) -> str:
    """Each pass's fixed and per-MB cost, fitted over the sizes."""
    sizes = ", ".join(f"{r['size']} {r['model_bytes'] / 1e6:.0f} MB" for r in results)
    lines = [f"fixed + per-MB cost, fitted over {sizes}:"]
    for t in transports:
        fixed, per_mb = overhead_fit(results, t)
        lines.append(f"  weightsync {t} above direct: {fixed:.1f} ms + {per_mb:.3f} ms/MB")
        by_pass: dict[str, list[tuple[float, float]]] = {}
        for r in results:
            for p in passes(r, t):
                by_pass.setdefault(p["pass"], []).append((r["model_bytes"] / 1e6, p["seconds"]))
        for name, pts in by_pass.items():
            f, s = fit(pts)
            lines.append(f"    {name:20s} {f:7.1f} ms + {s:.3f} ms/MB")
    return "\n".join(lines)


def report(res: dict[str, Any], profile: bool) -> str:
    n = res["model_bytes"]
    lines = [
        f"model {n / 1e6:.1f} MB ({res['size']}), buckets of {res['bucket_bytes'] / 1e6:.1f} MB, "
        f"medians of {res['repeats']} alternating repeats"
    ]
    for k, m in res["median_s"].items():
        label = {"direct": "direct layerwise reload", "disk": "disk: save_file + reload_weights"}.get(
            k, f"weightsync, {k}"
        )
        lines.append(
            f"  {label:34s} {m * 1e3:8.1f} ms [{res['min_s'][k] * 1e3:.0f}-"
            f"{res['max_s'][k] * 1e3:.0f}]  {n / m / 1e9:5.2f} GB/s  "
            f"x{res['ratio_vs_direct'][k]:.2f} direct"
        )
    if profile:
        for t, rows in res["profiles"].items():
            trainer = _median_phases([r["trainer"] for r in rows])
            lines.append(f"  profile, {t} (median seconds; phases overlap):")
            cpu = _median_phases([r["cpu"] for r in rows])
            lines.append(
                "    CPU per sync: "
                + "  ".join(f"{k} {v * 1e3:.0f}ms" for k, v in cpu.items())
                + f"  (all {sum(cpu.values()) * 1e3:.0f} ms on {os.cpu_count()} cores)"
            )
            lines.append("    trainer  " + "  ".join(f"{k} {v * 1e3:.1f}ms" for k, v in trainer.items()))
            engines = sorted({e for r in rows for e in r["engines"]})
            for e in engines:
                ph = _median_phases([r["engines"].get(e, {}) for r in rows])
                lines.append(f"    {e}  " + "  ".join(f"{k} {v * 1e3:.1f}ms" for k, v in ph.items()))
            lines.append(pass_table(res, t))
            lines.append(cpu_floor(res, t))
    return "\n".join(lines)


def missed_targets(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for res in results:
        ratios = res["ratio_vs_direct"]
        for t, target in (("shm", RATIO_TARGET), ("collective", RATIO_TARGET), ("inline", INLINE_TARGET)):
            if t in ratios and ratios[t] > target:
                out.append(
                    f"vLLM {t} <= {target}x direct: {ratios[t]:.2f}x ({res['size']}, "
                    f"{res['model_bytes'] / 1e6:.0f} MB)"
                )
        if "disk" in res["median_s"]:
            for t, m in res["median_s"].items():
                if t not in ("direct", "disk") and m >= res["median_s"]["disk"]:
                    out.append(
                        f"vLLM {t} faster than the disk path: {m * 1e3:.0f} ms vs "
                        f"{res['median_s']['disk'] * 1e3:.0f} ms ({res['size']})"
                    )
    if len(results) >= 2 and "shm" in results[0]["median_s"]:
        fixed, per_mb = overhead_fit(results, "shm")
        if per_mb > PER_MB_TARGET:
            out.append(
                f"vLLM shm overhead above direct <= {PER_MB_TARGET} ms/MB: {per_mb:.3f} ms/MB (+ {fixed:.1f} ms)"
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", help="tiny | small | medium, or a comma list")
    ap.add_argument("--bucket-bytes", type=int, default=16 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports", default="shm,collective,inline")
    ap.add_argument("--no-disk", dest="disk", action="store_false", help="skip the disk path")
    ap.add_argument("--profile", action="store_true", help="print where each sync's time goes")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from bench.common import machine

    transports = [t for t in args.transports.split(",") if t]
    results = []
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-vllm-") as tmp:
        for size in args.size.split(","):
            res = run_size(size, Path(tmp), args.bucket_bytes, args.repeats, transports, args.disk)
            print(report(res, args.profile), flush=True)
            results.append(res)
    if args.profile and len(results) >= 2:
        print(fit_table(results, transports), flush=True)
    missed = missed_targets(results)
    for line in missed:
        print(f"MISSED: {line}")
    accounts = {f"{r['size']}/{t}": passes(r, t) for r in results for t in transports}
    out = {
        "machine": machine(),
        "results": results,
        "passes": accounts,
        "missed": missed,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if args.check and missed:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
