"""`weightsync demo` / `make demo`: a trainer pushes versions through a local daemon into
torch engine processes, and every version is checked by digest and by a greedy probe.

Everything runs on this machine as real processes over ipc:// sockets in a temp dir, and
everything is stopped before returning.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


def run_demo(
    *,
    versions: int = 3,
    engines: int = 2,
    size: str = "small",
    bucket_bytes: int = 4 * 1024 * 1024,
    workdir: Path | None = None,
    backend: str = "torch",
    show: Callable[[Any], None] | None = None,
) -> bool:
    """`show(status)` renders the daemon's final status (the CLI passes its tables)."""
    from engines.torch_engine import load_model
    from examples.launch import Cluster
    from examples.tiny import build_tiny_llama, perturbed
    from messages.canary import make_probes

    console = Console(width=120)
    own = workdir is None  # a temp dir of ours: emptied at the end but for its logs
    workdir = Path(tempfile.mkdtemp(prefix="weightsync-demo-") if workdir is None else workdir)
    try:
        t0 = time.perf_counter()
        model_dir = build_tiny_llama(workdir / "model", size=size, seed=0)
        trainer = load_model(model_dir)
        base = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
        nparams = sum(v.numel() for v in base.values())
        console.print(
            f"model: random Llama '{size}', {nparams / 1e6:.1f}M parameters, "
            f"{len(base)} tensors, saved to {model_dir} ({time.perf_counter() - t0:.1f}s)"
        )
        delta = backend == "torch"  # torch engines keep a base copy: pushes may be deltas
        engine_args = ["--threads", "1", "--delta-base"] if delta else []
        cluster = Cluster(workdir, model_dir, engines=engines, backend=backend, engine_args=engine_args)
        all_ok = True
        console.print(f"starting the daemon and {engines} {backend} engine(s)...")
        with cluster:
            console.print(
                f"daemon {cluster.addr} with {engines} {backend} engine(s) registered; "
                f"logs in {cluster.log_dir}"
            )
            table = Table(title="pushes", title_justify="left")
            for col in (
                "version",
                "buckets",
                "MB",
                "sent as",
                "sync s",
                "MB/s",
                "digest",
                "probes match",
                "finalize_count",
            ):
                table.add_column(col)
            with cluster.client(timeout=60.0) as client:
                weights: dict[str, Any] = {}
                for v in range(1, versions + 2 if delta else versions + 1):
                    # the last version is a small step on the one before: a delta push
                    weights = dict(perturbed(base, v)) if v <= versions else small_step(weights)
                    trainer.load_state_dict(weights)
                    probes = make_probes(trainer, PROMPTS, 8)
                    expected = [p.expected for p in probes]
                    r = client.push(weights.items(), v, bucket_bytes=bucket_bytes, probes=probes, delta=delta)
                    d = r.detail.get("delta")
                    if d is None or d["base"] is None:
                        sent = "dense"
                    elif d["bytes"] >= 0.9 * d["dense_bytes"]:
                        sent = "dense (changed everywhere)"
                    else:
                        sent = f"delta on v{d['base']}"
                    engine_probes = {e["engine_id"]: [tuple(x) for x in e["probes"]] for e in r.engines}
                    match = (
                        all(ps == expected for ps in engine_probes.values()) and len(engine_probes) == engines
                    )
                    digests_ok = all(e["digest"] == r.digest for e in r.engines)
                    all_ok &= match and digests_ok
                    table.add_row(
                        str(v),
                        str(r.buckets),
                        f"{r.bytes / 1e6:.3f}",
                        sent,
                        f"{r.seconds:.3f}",
                        f"{r.throughput / 1e6:.0f}",
                        r.digest[:12] + ("" if digests_ok else " MISMATCH"),
                        f"{'yes' if match else 'NO'} ({len(engine_probes)}/{engines} engines)",
                        ",".join(str(e["finalize_count"]) for e in r.engines),
                    )
                    console.print(
                        f"version {v}: READY in {r.seconds:.3f}s, {r.bytes / 1e6:.3f} MB ({sent}), "
                        f"{r.throughput / 1e6:.0f} MB/s; every engine's probe matches the "
                        f"trainer: {'yes' if match else 'NO'}"
                    )
                st = client.status()
            console.print(table)
            if show is not None:
                show(st)
        leftover = [p.name for p in cluster.procs if p.popen.poll() is None]
        console.print(f"stopped {len(cluster.procs)} processes; still running: {leftover or 'none'}")
        return all_ok and not leftover
    finally:
        if own:  # the model, journal and spool go; the logs the run named stay
            for child in workdir.iterdir():
                if child.name == "logs":
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:  # files and the daemon's ipc sockets
                    child.unlink(missing_ok=True)
            console.print(f"logs kept in {workdir / 'logs'}")


def small_step(weights: dict[str, Any]) -> dict[str, Any]:
    """An RL step's typical change: a few values of a few tensors, the rest bit-identical."""
    import torch

    g = torch.Generator().manual_seed(7)
    out = {k: v.clone() for k, v in weights.items()}
    for name in sorted(out)[:4]:
        flat = out[name].view(-1)
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 1000),), generator=g)] += 0.01
    return out
