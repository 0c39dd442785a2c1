"""`weightsync demo` and `bench`: harnesses that run from a source checkout (examples/,
bench/), not from an installed package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, Optional

import typer

from messages.errors import WeightSyncError
from orchestrator.cli.tables import history_table, out_console, status_table
from orchestrator.cli.util import (
    EXIT_OK,
    EXIT_SYNC,
    _fail,
    _usage,
)


def demo(
    versions: int = typer.Option(3, help="versions to push"),
    engines: int = typer.Option(2, help="torch engine processes"),
    size: Literal["tiny", "small"] = typer.Option("small"),
    bucket_bytes: int = typer.Option(4 * 1024 * 1024),
    workdir: Optional[Path] = typer.Option(None, help="keep files here [default: a temp dir]"),
    backend: Literal["torch", "vllm"] = typer.Option("torch"),
) -> None:
    """Everything on this machine: daemon, engines, a trainer pushing VERSIONS versions."""
    try:
        from examples.demo import run_demo
    except ImportError:
        _usage(
            "weightsync demo runs from a source checkout (it needs examples/); "
            "run it in the repository, e.g. `make demo`"
        )
        return

    def show(st: dict[str, Any]) -> None:
        console = out_console()
        console.print(status_table(st))
        console.print(history_table(st))

    try:
        ok = run_demo(
            versions=versions,
            engines=engines,
            size=size,
            bucket_bytes=bucket_bytes,
            workdir=workdir,
            backend=backend,
            show=show,
        )
    except WeightSyncError as err:
        _fail(err, "demo")
        return
    raise typer.Exit(EXIT_OK if ok else EXIT_SYNC)


def bench(ctx: typer.Context) -> None:
    """Data-plane benchmark against raw ZeroMQ and memcpy (`python -m bench --help`).
    Run as its own process (`python -m bench`): the harness stays above the product,
    never imported by it."""
    if importlib.util.find_spec("bench") is None:
        _usage(
            "weightsync bench runs from a source checkout (it needs bench/); "
            "run it in the repository, e.g. `make bench`"
        )
        return
    raise typer.Exit(subprocess.run([sys.executable, "-m", "bench", *ctx.args], check=False).returncode)
