"""`weightsync serve` (the daemon in the foreground), `vllm-server` (vLLM's OpenAI server
ready for weightsync) and `keys generate` (the CURVE keys `serve --keys` reads)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from orchestrator.cli import config as cliconfig
from orchestrator.cli.util import (
    EXIT_STARTUP,
    EXIT_USAGE,
    LogLevel,
    SegmentDir,
    _check_bind,
    _config_error,
    _settings,
    err_console,
)
from orchestrator.daemon.config import (
    DEFAULT_ADDR,
    DEFAULT_ENGINE_ADDR,
    vllm_process_env,
)


def _default(setting: str) -> str:
    """The daemon's own default for a `serve` option, for its help: the option itself
    defaults to None, so that a WEIGHTSYNC_* variable or the config file still applies."""
    value = cliconfig.SETTINGS_DEFAULTS[setting]
    return f"{value:g}" if isinstance(value, float) else str(value)


def serve(
    bind: Optional[str] = typer.Option(None, help=f"trainer socket (default {DEFAULT_ADDR})"),
    engine_bind: Optional[str] = typer.Option(None, help=f"engine socket (default {DEFAULT_ENGINE_ADDR})"),
    fanout_bind: Optional[str] = typer.Option(
        None,
        help="where engines take published buckets (default beside the engine socket: "
        "its TCP port + 1, or PATH.fanout; 'off': one send per engine)",
    ),
    fanout_queue_bytes: Optional[int] = typer.Option(
        None,
        min=1 << 20,
        help="bytes of published buckets queued per fan-out connection (default 192 MiB): what a "
        "frozen engine or a subscriber that never reads can cost the daemon",
    ),
    state_db: Optional[str] = typer.Option(
        None, help="SQLite journal path (default weightsync-state.db); one daemon per journal"
    ),
    min_engines: Optional[int] = typer.Option(
        None, help=f"engines required to begin a sync (default {_default('min_engines')})"
    ),
    engine_timeout: Optional[float] = typer.Option(
        None,
        help=f"seconds without heartbeat before an engine is lost (default {_default('engine_timeout')})",
    ),
    lost_expiry: Optional[float] = typer.Option(
        None,
        help=f"seconds a LOST engine stays in status before it is forgotten (default {_default('lost_expiry')})",
    ),
    sync_timeout: Optional[float] = typer.Option(
        None,
        help=f"seconds without trainer activity before a sync fails (default {_default('sync_timeout')})",
    ),
    bucket_timeout: Optional[float] = typer.Option(
        None, help=f"seconds for every engine to apply a bucket (default {_default('bucket_timeout')})"
    ),
    finalize_timeout: Optional[float] = typer.Option(
        None, help=f"seconds for every engine to finalize (default {_default('finalize_timeout')})"
    ),
    spool: Optional[str] = typer.Option(None, help="keep the last READY version here: rollback and rejoin"),
    max_frame_bytes: Optional[int] = typer.Option(
        None, help=f"largest bucket frame accepted, in bytes (default {_default('max_frame_bytes')})"
    ),
    max_pending: Optional[int] = typer.Option(
        None, help=f"unanswered bucket requests per trainer (default {_default('max_pending')})"
    ),
    keys: Optional[str] = typer.Option(None, help="CURVE keys directory: only listed peers get in"),
    trainer_grace: Optional[float] = typer.Option(
        None,
        min=0.0,
        help=f"seconds a sync outlives its trainer's closed connection (default {_default('trainer_grace')})",
    ),
    engine_grace: Optional[float] = typer.Option(
        None,
        min=0.0,
        help="seconds an engine whose connection closed without a goodbye stays in the fleet "
        f"(a reconnect keeps it; default {_default('engine_grace')})",
    ),
    shm_dir: SegmentDir = None,
    metrics_bind: Optional[str] = typer.Option(
        None, help="HOST:PORT for Prometheus metrics over HTTP (default off)"
    ),
    failpoint: Optional[str] = typer.Option(None, hidden=True, help="fault injection (tests)"),
    log_level: Optional[LogLevel] = typer.Option(None, help=f"(default {_default('log_level')})"),
    log_json: Optional[bool] = typer.Option(
        None, "--log-json/--log-console", help="(default: JSON when stderr is not a terminal)"
    ),
) -> None:
    """Run the orchestrator daemon in the foreground (SIGTERM stops it gracefully)."""
    import sqlite3

    import zmq

    from orchestrator.daemon.logs import configure_logging
    from orchestrator.daemon.service import Service

    s = _settings(
        bind=bind,
        engine_bind=engine_bind,
        fanout_bind=fanout_bind,
        fanout_queue_bytes=fanout_queue_bytes,
        state_db=state_db,
        min_engines=min_engines,
        engine_timeout=engine_timeout,
        lost_expiry=lost_expiry,
        sync_timeout=sync_timeout,
        bucket_timeout=bucket_timeout,
        finalize_timeout=finalize_timeout,
        spool=spool,
        max_frame_bytes=max_frame_bytes,
        max_pending=max_pending,
        keys=keys,
        failpoints=failpoint,
        trainer_grace=trainer_grace,
        engine_grace=engine_grace,
        shm_dir=shm_dir,
        metrics_bind=metrics_bind,
        log_level=log_level,
        log_json=log_json,
    )
    _check_bind(s.bind, "--bind")
    _check_bind(s.engine_bind, "--engine-bind")
    _check_bind(s.fanout_bind, "--fanout-bind")
    configure_logging(s.log_level, s.log_json)
    from messages import segments
    from messages.keys import KeysError
    from orchestrator.daemon.locks import StateInUse

    segments.configure(s.shm_dir)
    service = None
    try:
        service = Service(s)
        service.startup()
    except KeysError as exc:
        if service is not None:
            service.abandon()
        _config_error(exc)
    except (zmq.ZMQError, OSError, sqlite3.Error, StateInUse) as exc:
        if service is not None:
            service.abandon()
        what = f"--state-db {s.state_db}: " if isinstance(exc, sqlite3.Error) else ""
        err_console.print(f"[red]startup failed:[/red] {escape(what + str(exc))}")
        raise typer.Exit(EXIT_STARTUP) from None
    asyncio.run(service.run())


def vllm_server(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="model directory (or name vLLM can load offline)"),
    host: str = typer.Option("127.0.0.1", help="address the OpenAI server listens on"),
    port: int = typer.Option(8000, min=1, max=65535, help="its port"),
    kv_cache_gib: Optional[int] = typer.Option(
        None, min=1, help="CPU KV cache in GiB (VLLM_CPU_KVCACHE_SPACE) [default: 1, or what is exported]"
    ),
    show: bool = typer.Option(False, "--print", help="print the environment and command, run nothing"),
) -> None:
    """Run vLLM's OpenAI server ready for weightsync: its weight-transfer routes on, our
    worker extension and `weightsync` transfer backend loaded. Attach it with `weightsync
    engine --backend vllm-server --url http://HOST:PORT --model MODEL`. Further arguments go
    to vLLM (e.g. --dtype float32 --enforce-eager --max-model-len 2048; --enable-scale-out
    for the token-in-token-out route, whose responses carry the weight version)."""
    import os
    import shlex

    from orchestrator.daemon.config import child_env

    env = {**vllm_process_env(True, kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1"}
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--worker-extension-cls",
        "engines.vllm_extension.WeightSyncExtension",
        "--weight-transfer-config",
        json.dumps({"backend": "weightsync"}),
        *ctx.args,
    ]
    if show:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())), shlex.join(argv))
        return
    os.execve(sys.executable, argv, child_env(env))  # the server is this process: signals reach it


def keys_generate(
    directory: Path = typer.Argument(..., help="keys directory (created if missing)"),
    trainer: list[str] = typer.Option(["trainer"], help="trainer identities to create"),
    engine: list[str] = typer.Option(["engine"], help="engine identities to create"),
) -> None:
    """Create the daemon's keypair (once) and allowlisted trainer and engine keypairs."""
    from messages.keys import KeysError, generate

    try:
        made = generate(directory, trainer, engine)
    except KeysError as exc:
        err_console.print(f"[red]keys:[/red] {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    for p in made:
        print(p)
