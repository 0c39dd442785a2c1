"""`weightsync engine`: a process that applies the weights the orchestrator pushes."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal, Optional

import typer
from rich.markup import escape

from orchestrator.cli.util import (
    EXIT_STARTUP,
    KeyName,
    LogLevel,
    SegmentDir,
    _check_endpoint,
    _client_keys,
    _config_error,
    _parse_kv,
    _settings,
    err_console,
)
from orchestrator.daemon.config import (
    DEFAULT_ENGINE_ADDR,
    ConfigError,
    parse_failpoints,
    set_process_env,
    vllm_process_env,
)


def engine(
    backend: Literal["torch", "vllm", "vllm-server", "sink"] = typer.Option(
        "torch", help="the engine (sink: benchmarks)"
    ),
    model: Path = typer.Option(..., exists=True, file_okay=False, help="local model directory"),
    connect: str = typer.Option(DEFAULT_ENGINE_ADDR, help="orchestrator engine socket"),
    engine_id: Optional[str] = typer.Option(None, help="[default HOST-PID]"),
    threads: Optional[int] = typer.Option(None, help="torch intra-op threads"),
    tp: int = typer.Option(
        1,
        min=1,
        max=64,
        help="torch: tensor-parallel ranks, each holding vLLM's Llama partition of the model "
        "(a sender cuts each rank its slices)",
    ),
    vllm_mp: bool = typer.Option(
        False, "--vllm-mp/--no-vllm-mp", help="vLLM V1 multiprocessing (workers in their own processes)"
    ),
    vllm_slices: bool = typer.Option(
        False,
        "--vllm-slices/--no-vllm-slices",
        help="vLLM: each tensor-parallel worker is sent only the slices its loaders keep "
        "(recorded from them at startup)",
    ),
    vllm_arg: list[str] = typer.Option(
        [], "--vllm-arg", help="KEY=VALUE passed to vllm.LLM (VALUE parsed as JSON if it can be)"
    ),
    url: Optional[str] = typer.Option(None, help="vllm-server backend: the server's base URL"),
    pause_mode: Literal["keep", "wait", "abort"] = typer.Option(
        "keep", help="vllm-server: what happens to in-flight requests during a sync"
    ),
    heartbeat_interval: Optional[float] = typer.Option(None),
    shm: bool = typer.Option(
        True, "--shm/--no-shm", help="offer the transports that carry references to shared memory"
    ),
    shm_dir: SegmentDir = None,
    lora_rank: int = typer.Option(
        0,
        min=0,
        max=1024,
        help="LoRA slots of this rank on --lora-targets "
        "(torch: adapter pushes merge at finalize; vllm: also pass "
        "--vllm-arg enable_lora=true)",
    ),
    lora_targets: str = typer.Option("", help="comma-separated module names for LoRA, e.g. q_proj,v_proj"),
    collective: bool = typer.Option(
        True,
        "--collective/--no-collective",
        help="offer the transports that broadcast in a torch.distributed group",
    ),
    collective_host: str = typer.Option(
        "",
        help="this host's address for a group's sockets [default: the route to the trainer's store]",
    ),
    keys: Optional[Path] = typer.Option(
        None, help="CURVE keys directory (needs server.key, NAME.key_secret)"
    ),
    key_name: KeyName = "engine",
    delta_base: bool = typer.Option(
        False,
        "--delta-base/--no-delta-base",
        help="keep a host-memory copy of the served checkpoint (one model's bytes) so the "
        "trainer may push deltas (push --delta)",
    ),
    digest_file: Optional[Path] = typer.Option(
        None,
        help="on SIGUSR1 the engine digests the weights it holds again (read back from their "
        "storage, not the digest its finalize recorded) and writes the answer here as JSON "
        "(asked, version, reported_digest, digest); it is logged either way (weights_rehashed)",
    ),
    failpoint: str = typer.Option("", hidden=True, help="fault injection (tests)"),
    log_level: Optional[LogLevel] = typer.Option(None),
    log_json: Optional[bool] = typer.Option(None, "--log-json/--log-console"),
) -> None:
    """Run an engine process that applies weights pushed through the orchestrator."""
    import os
    import signal

    from engines.worker import Worker, make_engine
    from orchestrator.daemon.logs import configure_logging

    s = _settings(
        heartbeat_interval=heartbeat_interval, log_level=log_level, log_json=log_json, shm_dir=shm_dir
    )
    configure_logging(s.log_level, s.log_json)
    from messages import segments

    segments.configure(s.shm_dir)
    _check_endpoint(connect, "--connect")
    curve = _client_keys(keys, key_name)
    try:
        failpoints = parse_failpoints(failpoint)
    except ConfigError as exc:
        _config_error(exc)
    if backend == "vllm":  # vLLM reads its settings from the environment at import
        set_process_env(vllm_process_env(vllm_mp))
    try:
        llm_args = _parse_kv(vllm_arg)
        eng = make_engine(
            backend,
            {
                "model": str(model),
                "threads": threads,
                "tp": tp,
                "vllm_mp": vllm_mp,
                "vllm_slices": vllm_slices,
                "llm_args": llm_args,
                "url": url,
                "pause_mode": pause_mode,
                "collective_host": collective_host,
                "lora_rank": lora_rank,
                "lora_targets": [t for t in lora_targets.split(",") if t],
            },
        )
    except Exception as exc:  # any backend failing to start is exit 3, with its reason
        err_console.print(f"[red]engine startup failed:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(EXIT_STARTUP) from None
    worker = Worker(
        eng,
        connect,
        engine_id or f"{socket.gethostname()}-{os.getpid()}",
        heartbeat_interval=s.heartbeat_interval,
        allow_refs=shm,
        keys=curve,
        failpoints=failpoints,
        groups=collective,
        collective_bind=collective_host,
        key_label=f"{key_name!r} in {keys}" if keys is not None else "",
        delta_base=delta_base,
        digest_file=digest_file,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.request_stop())
    signal.signal(signal.SIGUSR1, lambda *_: worker.request_digest())
    worker.run()
    if worker.refused:
        err_console.print(f"[red]engine refused by the orchestrator:[/red] {escape(worker.refused)}")
        raise typer.Exit(EXIT_STARTUP)
