"""Helpers for integration tests: a running daemon with real engine subprocesses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from examples.launch import Cluster

FAST_DAEMON = ["--engine-timeout", "3", "--log-level", "debug"]


def ws(*args: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`weightsync ARGS` as a user runs it (no stdin); its exit code and output."""
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
