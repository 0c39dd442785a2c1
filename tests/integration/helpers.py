"""Helpers for integration tests: a running daemon with real engine subprocesses."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.launch import Cluster
from messages import delta
from messages.buckets import Patched, iter_buckets
from messages.errors import WeightSyncError
from messages.schema import Patch

# An engine is lost after 10 s without a heartbeat: long enough that a shared CI host
# stalling every process for seconds does not fail a test about something else (one CI
# run lost an engine to a 5.5 s stall at 3 s); tests about hung engines use HANG_DAEMON.
FAST_DAEMON = ["--engine-timeout", "10", "--log-level", "debug"]
HANG_DAEMON = ["--engine-timeout", "3", "--log-level", "debug"]


def ws(*args: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`weightsync ARGS` as a user runs it (no stdin); its exit code and output. Its
    environment is this process's `os.environ` (unless `env=`): a library in the test
    process may have set COLUMNS=80 underneath it, which tables would then follow."""
    if "env" not in kw:
        from orchestrator.daemon.config import child_env

        kw["env"] = child_env()
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        **kw,
    )


@contextlib.contextmanager
def running_daemon(
    workdir: Path,
    model_dir: Path | None,
    *,
    engines: int = 2,
    daemon_args: list[str] | None = None,
    min_engines: int | None = None,
    engine_args: list[str] | None = None,
) -> Iterator[Cluster]:
    """A daemon plus `engines` torch engines; always stopped, logs shown on failure."""
    cluster = Cluster(
        Path(workdir),
        model_dir,
        engines=engines,
        min_engines=min_engines,
        daemon_args=daemon_args if daemon_args is not None else FAST_DAEMON,
        engine_args=["--threads", "1", "--heartbeat-interval", "0.5", *(engine_args or [])],
    )
    try:
        with cluster:
            yield cluster
    except BaseException:
        for p in cluster.procs:
            print(f"----- {p.name} log -----\n{p.log_tail(60)}")
        raise


# A trainer process that streams part of version VERSION, says STREAMING, then stalls (for
# tests that kill it mid-sync). argv: ADDR MODEL_DIR VERSION TRANSPORT
STALLING_TRAINER = r"""
import sys, time
from examples.tiny import perturbed
from engines.torch_engine import load_model
from orchestrator.trainer.client import TrainerClient
addr, model, version, transport = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
state = load_model(model).state_dict()
c = TrainerClient(addr, timeout=60)
def slow():
    for i, item in enumerate(perturbed(state, version)):
        if i == 6:
            print("STREAMING", flush=True)
            time.sleep(60)
        yield item
c.push(slow(), version, bucket_bytes=64 * 1024, transport=transport)
"""


def sigint_default() -> None:
    """`preexec_fn` for a child a test interrupts with SIGINT: a shell that starts the suite
    in the background hands its children SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler (the child would never see the Ctrl-C the test sends)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(pred: Any, timeout: float, what: str, every: float = 0.1) -> Any:
    """`pred()`'s first truthy value within `timeout` seconds, else an AssertionError
    naming `what` (a condition, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout}s: {what}")


def finalized_syncs(proc: Any) -> list[str]:
    """The sync ids an engine process ran its post-load step for, from its own log (one
    `engine_finalized` line each): what a test that says "nothing finalized" checks."""
    out = []
    for line in Path(proc.log_path).read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "engine_finalized":
            out.append(event.get("sync_id"))
    return out


def small_step(
    weights: dict[str, Any], seed: int, tensors: int = 3, elements: int = 50, by: float = 0.01
) -> dict[str, Any]:
    """A small optimizer step: `elements` values of `tensors` tensors change, the rest not."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in weights.items()}
    for n in [n for n in sorted(out) if out[n].numel() > 1000][:tensors]:
        flat = out[n].view(-1)
        flat[torch.randint(0, flat.numel(), (elements,), generator=g)] += by
    return out


def push_lying_delta(
    client: Any, weights: dict[str, Any], version: int, seed: int, at: int, by: float
) -> WeightSyncError:
    """Push `version + 1` as a delta on `version` (which the fleet serves as `weights`) whose
    one patch claims to rebuild a small step of a tensor but rebuilds that step with
    element `at` moved by `by`: bucket checksums right, rebuild wrong. Returns the error."""
    name = sorted(n for n in weights if weights[n].numel() > 1000)[0]
    good = small_step(weights, seed)[name]
    wrong = good.clone()
    wrong.view(-1)[at] += by
    enc, _ = delta.encode(name, wrong, weights[name], lambda: delta.part(name, weights[name]))
    assert enc.patch is not None and enc.patch.kind == "sparse"
    lie = Patch("sparse", enc.patch.base, delta.part(name, good), enc.patch.count)
    items = [(n, Patched(lie, enc.data, t.dtype, t.shape) if n == name else t) for n, t in weights.items()]
    sid = client.begin(version + 1, base=version).sync_id
    with pytest.raises(WeightSyncError) as ei:
        for b in iter_buckets(items, 1 << 20):
            client.send_bucket(sid, b)
        client.finish(sid, 1)
    return ei.value
