"""The `weightsync` command (see docs/ and README: serve, engine, push, status, abort, keys, demo).

Exit codes: 0 ok, 2 usage or configuration error (a wrong address included: the daemon's
engine socket given as --addr), 3 startup failure (an engine the daemon refused, or one
pointed at the trainer socket, too), 4 sync failed (or a request refused: the message
carries the error code), 130 interrupted.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Literal, Optional

import typer
from rich.markup import escape

from messages import transports
from messages.errors import ErrorCode, WeightSyncError
from messages.schema import DEFAULT_BUCKET_BYTES
from orchestrator.cli import config as cliconfig
from orchestrator.cli.tables import history_table, out_console, push_progress, status_table
from orchestrator.cli.util import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STARTUP,
    EXIT_SYNC,
    EXIT_USAGE,
    _check_bind,
    _check_endpoint,
    _client,
    _client_keys,
    _fail,
    _parse_kv,
    _settings,
    _usage,
    err_console,
    quiet_log_events,
    transport_name,
)
from orchestrator.daemon.config import (
    DEFAULT_ADDR,
    DEFAULT_ENGINE_ADDR,
    ConfigError,
    parse_failpoints,
    set_process_env,
    vllm_process_env,
)

LogLevel = Literal["debug", "info", "warning", "error", "critical"]

# rich_markup_mode=None: plain click help and errors (help text keeps its [brackets], a
# usage error is the one line main() prints, never a panel).
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Weight sync between RL trainers and inference engines. Every option can "
    "also come from WEIGHTSYNC_<OPTION> or a TOML --config file.",
)


@app.callback()
def root(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        envvar="WEIGHTSYNC_CONFIG",
        help="TOML file of option defaults: top-level keys for every command, [serve], [push] ... tables",
    ),
    transport_modules: str = typer.Option(
        "",
        "--transport-modules",
        envvar="WEIGHTSYNC_TRANSPORT_MODULES",
        help="modules to import that register transports (comma-separated; the daemon, engines and trainers alike)",
    ),
) -> None:
    """Weight sync between RL trainers and inference engines."""
    try:
        transports.load_modules(transports.split_modules(transport_modules))
    except transports.TransportError as exc:
        _usage(str(exc))
    try:
        if ctx.invoked_subcommand not in (None, "config"):  # `config show` checks what it shows
            cliconfig.check_env(ctx.command, (ctx.invoked_subcommand,))
        if config is not None:
            ctx.default_map = cliconfig.default_map(cliconfig.load(config), ctx.command, f"config {config}")
    except cliconfig.ConfigFileError as exc:
        _usage(str(exc))


config_app = typer.Typer(
    help="Settings: what each option is and where it came from.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(
    ctx: typer.Context,
    command: Optional[list[str]] = typer.Argument(None, help="only these commands"),
    as_json: bool = typer.Option(False, "--json", help="a JSON list on stdout"),
) -> None:
    """Print every option's effective value and its source (flag, env, config file, default)."""
    try:
        cliconfig.show(ctx.find_root(), tuple(command or ()), as_json)
    except cliconfig.ConfigFileError as exc:
        _usage(str(exc))


def _default(setting: str) -> str:
    """The daemon's own default for a `serve` option, for its help: the option itself
    defaults to None, so that a WEIGHTSYNC_* variable or the config file still applies."""
    value = cliconfig.SETTINGS_DEFAULTS[setting]
    return f"{value:g}" if isinstance(value, float) else str(value)


@app.command()
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
    shm_dir: Optional[str] = typer.Option(None, help="shared-memory directory (default /dev/shm)"),
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
        shm_dir=shm_dir,
        metrics_bind=metrics_bind,
        log_level=log_level,
        log_json=log_json,
    )
    _check_bind(s.bind, "--bind")
    _check_bind(s.engine_bind, "--engine-bind")
    _check_bind(s.fanout_bind, "--fanout-bind")
    configure_logging(s.log_level, s.log_json)
    from messages import shm
    from messages.keys import KeysError
    from orchestrator.daemon.locks import StateInUse

    shm.configure(s.shm_dir)
    service = None
    try:
        service = Service(s)
        service.startup()
    except KeysError as exc:
        if service is not None:
            service.abandon()
        err_console.print(f"[red]configuration error:[/red] {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from None
    except (zmq.ZMQError, OSError, sqlite3.Error, StateInUse) as exc:
        if service is not None:
            service.abandon()
        what = f"--state-db {s.state_db}: " if isinstance(exc, sqlite3.Error) else ""
        err_console.print(f"[red]startup failed:[/red] {escape(what + str(exc))}")
        raise typer.Exit(EXIT_STARTUP) from None
    asyncio.run(service.run())


@app.command("vllm-server", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
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


@app.command()
def engine(
    backend: Literal["torch", "vllm", "vllm-server", "sink"] = typer.Option(
        "torch", help="the engine (sink: benchmarks)"
    ),
    model: Path = typer.Option(..., exists=True, file_okay=False, help="local model directory"),
    connect: str = typer.Option(DEFAULT_ENGINE_ADDR, help="orchestrator engine socket"),
    engine_id: Optional[str] = typer.Option(None, help="[default HOST-PID]"),
    threads: Optional[int] = typer.Option(None, help="torch intra-op threads"),
    vllm_mp: bool = typer.Option(
        False, "--vllm-mp/--no-vllm-mp", help="vLLM V1 multiprocessing (workers in their own processes)"
    ),
    vllm_arg: list[str] = typer.Option(
        [], "--vllm-arg", help="KEY=VALUE passed to vllm.LLM (VALUE parsed as JSON if it can be)"
    ),
    url: Optional[str] = typer.Option(None, help="vllm-server backend: the server's base URL"),
    pause_mode: Literal["keep", "wait", "abort"] = typer.Option(
        "keep", help="vllm-server: what happens to in-flight requests during a sync"
    ),
    heartbeat_interval: Optional[float] = typer.Option(None),
    shm: bool = typer.Option(True, "--shm/--no-shm", help="offer the shared-memory transport"),
    shm_dir: Optional[str] = typer.Option(None, help="shared-memory directory (default /dev/shm)"),
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
        True, "--collective/--no-collective", help="offer the collective transport (torch.distributed)"
    ),
    collective_host: str = typer.Option(
        "",
        help="this host's address for the collective group's "
        "sockets [default: the route to the trainer's store]",
    ),
    keys: Optional[Path] = typer.Option(
        None, help="CURVE keys directory (needs server.key, NAME.key_secret)"
    ),
    key_name: str = typer.Option("engine", help="identity in the keys directory"),
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
    from messages import shm as shm_mod

    shm_mod.configure(s.shm_dir)
    _check_endpoint(connect, "--connect")
    curve = _client_keys(keys, key_name)
    try:
        failpoints = parse_failpoints(failpoint)
    except ConfigError as exc:
        err_console.print(f"[red]configuration error:[/red] {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    if backend == "vllm":  # vLLM reads its settings from the environment at import
        set_process_env(vllm_process_env(vllm_mp))
    try:
        llm_args = _parse_kv(vllm_arg)
        eng = make_engine(
            backend,
            {
                "model": str(model),
                "threads": threads,
                "vllm_mp": vllm_mp,
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
        allow_shm=shm,
        keys=curve,
        failpoints=failpoints,
        collective=collective,
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


keys_app = typer.Typer(help="CURVE keys for `serve --keys`.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
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


@app.command()
def status(
    addr: str = typer.Option(DEFAULT_ADDR, help="daemon trainer socket"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
    watch: Optional[float] = typer.Option(None, min=0.1, help="refresh every N seconds"),
    timeout: float = typer.Option(5.0, min=0.1, help="seconds to wait for the daemon"),
    keys: Optional[Path] = typer.Option(None, help="CURVE keys directory"),
    key_name: str = typer.Option("trainer", help="identity in the keys directory"),
) -> None:
    """Show the daemon's state, engines and recent transitions.

    With --watch it keeps watching across a daemon restart: a daemon that stops answering
    is said once (a line, or with --json an object with "waiting": "daemon"), and the
    status resumes when it answers again. Ctrl-C or SIGTERM ends it (exit 130)."""
    import signal

    from orchestrator.trainer.watch import no_answer

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM is a Ctrl-C (exit 130)
    console = out_console()
    down_since: float | None = None  # when the watched daemon stopped answering
    with _client(addr, keys, key_name, timeout=timeout, retries=0) as c:
        try:
            while True:
                try:
                    st = c.status()
                except WeightSyncError as err:
                    if not watch or not no_answer(err):
                        raise
                    if down_since is None:  # said once per outage; the watch goes on
                        down_since = time.monotonic()
                        _say_down(err, addr, as_json)
                    time.sleep(watch)
                    continue
                back = ""
                if down_since is not None:
                    back = f"the daemon at {addr} answers again after {time.monotonic() - down_since:.1f}s"
                    down_since = None
                if as_json:
                    print(json.dumps(st, sort_keys=True), flush=True)
                else:
                    if watch:
                        console.clear()
                    console.print(status_table(st))
                    console.print(history_table(st))
                    if back:
                        console.print(back)
                if not watch:
                    return
                time.sleep(watch)
        except WeightSyncError as err:
            _fail(err, "status", as_json)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None


def _say_down(err: WeightSyncError, addr: str, as_json: bool) -> None:
    """`status --watch`: the daemon stopped answering (stopped, restarting); still watching."""
    text = " ".join(err.message.split())
    if as_json:
        print(
            json.dumps(
                {"ok": False, "waiting": "daemon", "addr": addr, **err.to_fields()},
                sort_keys=True,
                default=str,
            ),
            flush=True,
        )
        return
    print(f"the daemon at {addr} does not answer ({err.code.value}: {text}); still watching", flush=True)


@app.command()
def abort(
    sync_id: Optional[str] = typer.Option(None, help="the sync to end (default: the running one)"),
    reason: str = typer.Option("no reason given", help="recorded in status and the journal"),
    addr: str = typer.Option(DEFAULT_ADDR, help="daemon trainer socket"),
    timeout: float = typer.Option(10.0, min=0.1, help="seconds to wait for the daemon"),
    as_json: bool = typer.Option(False, "--json"),
    keys: Optional[Path] = typer.Option(None, help="CURVE keys directory"),
    key_name: str = typer.Option("trainer", help="identity in the keys directory"),
) -> None:
    """End a running sync (for example one whose trainer died) so the next push can begin."""
    with _client(addr, keys, key_name, timeout=timeout, retries=0) as c:
        try:
            if sync_id is None:
                running = c.status().get("sync")
                if not running:
                    out = {"ok": True, "aborted": None, "message": "no sync is running"}
                    print(json.dumps(out) if as_json else "no sync is running; nothing to abort")
                    return
                sync_id = str(running["sync_id"])
            body = c.abort(sync_id, reason=reason[:4000], by="operator")
        except WeightSyncError as err:
            _fail(err, "abort", as_json)
            return
    if as_json:
        print(json.dumps({"ok": True, "aborted": sync_id, **body}, sort_keys=True, default=str))
    else:
        print(
            f"aborted sync {sync_id}: daemon {body.get('state')}, version {body.get('version')}, "
            f"dirty={body.get('dirty')}"
        )


INT63 = 2**63 - 1


def _read_probes(path: Path) -> list[Any]:
    """A probes file, checked against the wire schema (the constraints the daemon applies)."""
    import msgspec

    from messages.schema import Probe

    try:
        return msgspec.json.decode(path.read_bytes(), type=list[Probe])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        _usage(f"--probes {path}: {exc}")
        return []


@app.command()
def push(
    checkpoint: Path = typer.Argument(
        ..., exists=True, file_okay=False, help="directory of *.safetensors files"
    ),
    version: int = typer.Option(..., min=0, max=INT63, help="version number (must be newer than served)"),
    addr: str = typer.Option(DEFAULT_ADDR, help="daemon trainer socket"),
    bucket_bytes: int = typer.Option(DEFAULT_BUCKET_BYTES, min=4096, max=2**40, help="bytes per bucket"),
    window: Optional[int] = typer.Option(
        None,
        min=1,
        max=64,
        help="unacknowledged buckets in flight [default: sized from measured acks, 2 to 8]",
    ),
    timeout: float = typer.Option(60.0, min=0.1, help="seconds per request before a resend"),
    transport: str = typer.Option(
        "auto", callback=transport_name, help="auto, or a transport's name (--transport-modules may add some)"
    ),
    collective_host: str = typer.Option(
        "", help="collective: this host's address for the group's store [default: the route to the daemon]"
    ),
    partial: bool = typer.Option(
        False, "--partial", help="the checkpoint is a subset of the engines' tensors on purpose"
    ),
    engines_wait: float = typer.Option(
        0.0, min=0.0, help="seconds to wait for engines to register (default: fail at once)"
    ),
    shm_dir: Optional[str] = typer.Option(None, help="shared-memory directory (default /dev/shm)"),
    probes: Optional[Path] = typer.Option(
        None,
        exists=True,
        dir_okay=False,
        help="canary probes, a JSON array of {prompt, max_tokens, expected} (docs/TRAINER.md): "
        "every engine greedy-decodes each prompt after finalize and must answer `expected`",
    ),
    delta_from: Optional[Path] = typer.Option(
        None,
        exists=True,
        file_okay=False,
        help="the checkpoint the fleet serves now: send only what changed against it "
        "(engines need --delta-base; refused, the push goes dense)",
    ),
    as_json: bool = typer.Option(False, "--json"),
    keys: Optional[Path] = typer.Option(None, help="CURVE keys directory"),
    key_name: str = typer.Option("trainer", help="identity in the keys directory"),
) -> None:
    """Push a safetensors checkpoint to every engine as VERSION."""
    import signal

    from messages import shm
    from messages.checkpoint import Checkpoint, CheckpointError, iter_safetensors

    shm.configure(_settings(shm_dir=shm_dir).shm_dir)
    canaries = _read_probes(probes) if probes is not None else []
    try:
        iter_safetensors(checkpoint)  # refuse an unreadable checkpoint before connecting
        named = Checkpoint(checkpoint)
    except CheckpointError as exc:
        _usage(f"cannot read checkpoint: {exc}")
    # SIGTERM ends a push like Ctrl-C: the client aborts the sync it began on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with (
        _client(addr, keys, key_name, timeout=timeout, collective_host=collective_host) as c,
        push_progress(checkpoint, version, enabled=not as_json and sys.stdout.isatty()) as progress,
    ):
        served: int | None = None
        try:
            if delta_from is not None:
                quiet_log_events("delta_refused")  # a refusal is this command's own line, below
                st = c.status()
                if st.get("state") == "READY" and st.get("version") is not None:
                    served = int(st["version"])
                    c.delta_base.adopt(iter_safetensors(delta_from), served)
            r = c.push(
                named,
                version,
                delta=delta_from is not None,
                bucket_bytes=bucket_bytes,
                window=window,
                transport=transport,
                partial=partial,
                progress=progress,
                engines_wait=engines_wait,
                probes=canaries,
            )
        except WeightSyncError as err:
            if c.began is not None or err.code is ErrorCode.TIMEOUT:  # a sync may have begun
                _settle(c, err, timeout)
            _fail(err, "push", as_json, version=version)  # a refused begin: said at once
            return
        except KeyboardInterrupt:  # the client aborted the sync it began on the way out
            err_console.print(
                f"push interrupted: the sync of version {version} was aborted; "
                f"`weightsync status` shows what the engines serve"
            )
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except CheckpointError as exc:
            _usage(f"cannot read checkpoint: {exc} (the sync was aborted)")
            return
    out = {
        "ok": True,
        "sync_id": r.sync_id,
        "version": r.version,
        "state": r.state,
        "buckets": r.buckets,
        "bytes": r.bytes,
        "seconds": round(r.seconds, 4),
        "digest": r.digest,
        "throughput_mb_s": round(r.throughput / 1e6, 1),
        "transport": r.detail.get("transport"),
        "engines": [e["engine_id"] for e in r.engines],
        **({"delta": r.detail["delta"]} if "delta" in r.detail else {}),
    }
    if as_json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(
            f"version {r.version} {r.state}: {r.buckets} buckets, {r.bytes} bytes in "
            f"{r.seconds:.3f}s ({r.throughput / 1e6:.1f} MB/s) to {len(r.engines)} engine(s); "
            f"digest {r.digest}"
        )
        d = r.detail.get("delta")
        if d is not None and d["base"] is not None:
            print(
                f"delta against version {d['base']}: {d['bytes']} of {d['dense_bytes']} bytes, {d['tensors']}"
            )
        elif d is not None:
            print(f"pushed dense, not as a delta: {_why_dense(d, delta_from, served)}")


@app.command()
def watch(
    directory: Path = typer.Argument(
        ..., file_okay=False, help="folder the trainer writes step directories into"
    ),
    addr: str = typer.Option(DEFAULT_ADDR, help="daemon trainer socket"),
    marker: Optional[str] = typer.Option(
        None, help="a step directory is complete once this file exists in it (prime-rl: STABLE)"
    ),
    version_from: Optional[str] = typer.Option(
        None, help="regex with one group: the version in a directory's name [default: its last digits]"
    ),
    settle: float = typer.Option(
        2.0, min=0.0, help="without --marker: seconds a directory's files must stay unchanged"
    ),
    poll: float = typer.Option(1.0, min=0.05, help="seconds between scans"),
    until: Optional[int] = typer.Option(None, min=0, help="exit once this version (or newer) is served"),
    retries: int = typer.Option(3, min=1, help="pushes of one version before giving it up"),
    delta: bool = typer.Option(
        False, "--delta", help="push what changed since the previous version (engines need --delta-base)"
    ),
    bucket_bytes: int = typer.Option(DEFAULT_BUCKET_BYTES, min=4096, max=2**40, help="bytes per bucket"),
    transport: str = typer.Option(
        "auto", callback=transport_name, help="auto, or a transport's name (--transport-modules may add some)"
    ),
    timeout: float = typer.Option(60.0, min=0.1, help="seconds per request before a resend"),
    engines_wait: float = typer.Option(0.0, min=0.0, help="seconds to wait for engines to register"),
    wait_daemon: float = typer.Option(
        0.0,
        min=0.0,
        help="seconds in a row to wait for a daemon that does not answer, or has no engines, "
        "before exiting 4; 0: forever",
        show_default="0: forever",
    ),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line and event"),
    keys: Optional[Path] = typer.Option(None, help="CURVE keys directory"),
    key_name: str = typer.Option("trainer", help="identity in the keys directory"),
) -> None:
    """Push each complete checkpoint that appears under DIRECTORY as its version, in order.

    A daemon that does not answer (stopped, restarting, not started yet), a fleet without
    engines, or a push cut by a daemon restart is waited for (one `waiting` line when it
    begins, `resumed` when it ends), never counted against a step; only a refusal is.

    Exit 0 when stopped (SIGTERM, Ctrl-C) or --until is served; 4 if a version was refused
    (out of order), given up after --retries refused pushes, or --wait-daemon ran out."""
    import re
    import signal

    from orchestrator.trainer.watch import Watcher

    try:
        pattern = re.compile(version_from) if version_from is not None else None
    except re.error as exc:
        _usage(f"--version-from {version_from!r}: {exc}")
        return
    if pattern is not None and pattern.groups != 1:
        _usage(f"--version-from {version_from!r}: needs exactly one group (the version)")
    bad: list[dict[str, Any]] = []

    def emit(event: dict[str, Any]) -> None:
        if event["event"] in ("refused", "gave_up"):
            bad.append(event)
        if as_json:
            print(json.dumps(event, sort_keys=True, default=str), flush=True)
            return
        if event["event"] in ("waiting", "resumed"):
            whom = "the daemon" if event["for"] == "daemon" else "engines to register"
            if event["event"] == "waiting":
                print(
                    f"waiting for {whom} ({event['waited_s']}s so far): {event['code']} {event['reason']}",
                    flush=True,
                )
            else:
                print(f"resumed: waited {event['waited_s']}s for {whom}", flush=True)
            return
        what = f"version {event['version']} ({event['path']}): {event['event']}"
        if event["version"] is None:
            what = f"{event['path']}: {event['event']}"
        if event["event"] == "pushed":
            what += f" {event['state']}, {event['buckets']} buckets, {event['bytes']} bytes in {event['seconds']}s"
        elif "reason" in event:
            what += f": {event.get('code', '') + ' ' if event.get('code') else ''}{event['reason']}"
        print(what, flush=True)

    stopping = False

    def on_signal(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    probe = min(timeout, 5.0)  # a status while waiting: no answer this soon is still a wait
    with _client(addr, keys, key_name, timeout=timeout, connect_timeout=probe) as c:
        w = Watcher(
            directory,
            c,
            emit,
            marker=marker,
            version_from=pattern,
            settle=settle,
            retries=retries,
            delta=delta,
            wait_daemon=wait_daemon,
            probe_timeout=probe,
            push_options={"bucket_bytes": bucket_bytes, "transport": transport, "engines_wait": engines_wait},
        )

        def done() -> bool:
            if stopping:
                return True
            if until is None:
                return False
            try:
                served = c.status(timeout=probe, retries=0).get("last_ready_version")
            except WeightSyncError:
                return False
            return served is not None and served >= until

        try:
            w.run(poll, done)
        except WeightSyncError as err:
            _fail(err, "watch", as_json)
    raise typer.Exit(EXIT_SYNC if bad else EXIT_OK)


def _why_dense(d: dict[str, Any], delta_from: Path | None, served: int | None) -> str:
    """Why `push --delta-from` sent the whole checkpoint, in the user's terms: a base the
    engines do not hold is named (the directory, the version it was taken for, which engine
    holds another copy of which tensor), not reported as an engine failure."""
    refused = d.get("refused")
    if refused is not None:
        other = re.search(r"failed: (\S+): the patch applies to .*\(a different base\)", refused["message"])
        if other is not None:
            return (
                f"--delta-from {delta_from} is not the checkpoint the fleet serves as version "
                f"{refused['base']} ({refused.get('engine_id') or 'an engine'} holds another "
                f"{other.group(1)}); give the directory version {refused['base']} was pushed from"
            )
        return f"the engines refused a delta against version {refused['base']}: {refused['message']}"
    if served is None:
        return "the daemon serves no version to patch against yet"
    return str(d.get("why"))


def _settle(c: Any, err: WeightSyncError, wait: float) -> None:
    """A failed push reports the state the daemon settles in: a dirty daemon with a spool
    rolls the engines back right after the failure, so the state in the error (IDLE,
    version None) is not what the fleet serves a moment later. Waits up to `wait` seconds
    for no sync and no rollback pending, then puts that state and version on `err`
    (`details.settled`: whether it did settle). Only for a push whose sync began (or whose
    begin went unanswered): a refused begin changed nothing, and its refusal (another
    sync's age, say) is said at once, not after that sync ends."""
    if err.state in (None, "READY"):
        return
    deadline = time.monotonic() + wait
    settled = False
    while not settled:
        try:
            st = c.status()
        except WeightSyncError:
            break
        settled = st.get("sync") is None and not st.get("rollback_pending")
        if settled:
            err.state, err.version = st.get("state"), st.get("version")
        elif time.monotonic() > deadline:
            break
        else:
            time.sleep(0.1)
    err.details["settled"] = settled


@app.command()
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


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context) -> None:
    """Data-plane benchmark against raw ZeroMQ and memcpy (`python -m bench --help`)."""
    try:
        from bench.throughput import main as bench_main
    except ImportError:
        _usage(
            "weightsync bench runs from a source checkout (it needs bench/); "
            "run it in the repository, e.g. `make bench`"
        )
        return
    bench_main(list(ctx.args))


def command() -> Any:
    """The click command behind `weightsync`, each option wired to its WEIGHTSYNC_* variable."""
    cmd = typer.main.get_command(app)
    cliconfig.wire_envvars(cmd)
    return cmd


def _usage_text(exc: Any, ctx: Any) -> str:
    """click's message on one line; "(env var: ...)" only when the value came from there."""
    text = " ".join(exc.format_message().split())
    param = getattr(exc, "param", None)
    if ctx is not None and param is not None and param.name:
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name != "ENVIRONMENT":
            text = re.sub(r" \(env var: '[^']*'\)", "", text)
    return text


# Typer carries its own copy of click (typer._click): its exception classes, by their names.
_CLICK: dict[str, Any] = {c.__name__: c for c in typer.BadParameter.__mro__[:-2]}


def main(argv: list[str] | None = None) -> None:
    """Run `weightsync`; a usage error is one line on stderr naming the command, exit 2."""
    try:
        rv = command().main(args=argv, prog_name="weightsync", standalone_mode=False)
    except _CLICK["UsageError"] as exc:
        ctx: Any = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # `weightsync`, `weightsync keys`: the help
            print(exc.format_message())
            sys.exit(EXIT_OK)
        where = ctx.command_path if ctx is not None else "weightsync"
        print(f"error: {where}: {_usage_text(exc, ctx)} (see '{where} --help')", file=sys.stderr)
        sys.exit(exc.exit_code)
    except _CLICK["ClickException"] as exc:
        print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(rv if isinstance(rv, int) else 0)
