"""Helpers shared by the `weightsync` subcommands: one-line errors with documented exit
codes, the options the trainer-side commands share, settings, clients, addresses and keys.

Exit codes: 0 ok, 2 usage or configuration error (a wrong address included: the daemon's
engine socket given as --addr), 3 startup failure (an engine the daemon refused, or one
pointed at the trainer socket, too), 4 sync failed (or a request refused: the message
carries the error code), 130 interrupted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, NoReturn, Optional, TypedDict, Unpack

import typer
from rich.console import Console
from rich.markup import escape

from messages import transports
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.daemon.config import ConfigError, Settings, load_settings

if TYPE_CHECKING:
    from messages.keys import ClientKeys
    from messages.replies import JsonObject
    from orchestrator.trainer.client import TrainerClient

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
EXIT_OK, EXIT_USAGE, EXIT_STARTUP, EXIT_SYNC, EXIT_INTERRUPTED = 0, 2, 3, 4, 130
err_console = Console(stderr=True, soft_wrap=True)  # one message, one line


# The options every command that talks to the daemon as a trainer takes, said once.
Addr = Annotated[str, typer.Option(help="daemon trainer socket")]
TrainerKeys = Annotated[Optional[Path], typer.Option(help="CURVE keys directory")]
KeyName = Annotated[str, typer.Option(help="identity in the keys directory")]
BucketBytes = Annotated[int, typer.Option(min=4096, max=2**40, help="bytes per bucket")]
# the directory of this process's shared-memory segments (daemon, engine, push alike)
SegmentDir = Annotated[
    Optional[str], typer.Option(help=f"shared-memory directory (default {Settings.shm_dir})")
]


def _config_error(exc: Exception) -> NoReturn:
    """A setting, a failpoint or a keys directory that cannot be used: one line, exit 2."""
    err_console.print(f"[red]configuration error:[/red] {escape(str(exc))}")
    raise typer.Exit(EXIT_USAGE) from None


def _settings(**kw: object) -> Settings:
    try:
        return load_settings(**kw)
    except ConfigError as exc:
        _config_error(exc)


def _fail(err: WeightSyncError, what: str, as_json: bool = False, version: int | None = None) -> None:
    """One line on stderr (and with --json a JSON object on stdout), exit 4; a wrong --addr
    (the daemon's engine socket: WRONG_SOCKET) is a usage error, exit 2. `version`: the
    version the command was about (push's --version): the object's `version`, while the
    daemon's own, which the error carries, is `daemon_version` beside `state`."""
    if as_json:  # scripts read stdout: the failure is a JSON object there too
        fields = {**err.to_fields(), "daemon_version": err.version}
        if version is not None:
            fields["version"] = version
        print(json.dumps({"ok": False, **fields}, sort_keys=True, default=str))
    where = f" (daemon state {err.state}, version {err.version})" if err.state else ""
    text = " ".join(err.message.split())
    err_console.print(f"[red]{what} failed: {err.code.value}[/red]: {escape(text)}{where}")
    raise typer.Exit(EXIT_USAGE if err.code is ErrorCode.WRONG_SOCKET else EXIT_SYNC)


def _usage(message: str) -> NoReturn:
    """A bad argument, file or address: one line, exit 2."""
    err_console.print(f"[red]error:[/red] {escape(' '.join(message.split()))}")
    raise typer.Exit(EXIT_USAGE)


def transport_name(value: str) -> str:
    """An option callback: auto, or a registered transport's name (messages.transports),
    checked as the value is processed, after the root command loaded --transport-modules."""
    if value != transports.AUTO and transports.get(value) is None:
        raise typer.BadParameter(f"{value!r} is not auto nor one of {', '.join(transports.names())}")
    return value


class _ClientArgs(TypedDict, total=False):
    """The `TrainerClient` options the commands set (besides its address and keys)."""

    timeout: float
    retries: int
    connect_timeout: float
    collective_host: str


def _client(addr: str, keys: Optional[Path], key_name: str, **kw: Unpack[_ClientArgs]) -> TrainerClient:
    from orchestrator.daemon.logs import configure_logging
    from orchestrator.trainer.client import TrainerClient

    # stdout is the command's answer (a table, or JSON for scripts); warnings go to stderr
    configure_logging("warning", json=False)
    curve = _client_keys(keys, key_name)
    try:
        return TrainerClient(addr, keys=curve, **kw)
    except ValueError as exc:
        _usage(f"--addr: {exc}")


def quiet_log_events(*events: str) -> None:
    """Drop the library's log lines of these events (after `_client` configured them):
    for what a command reports in its own words instead of twice."""
    import logging

    from messages import liblog

    def keep(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(text.startswith(e + " ") or f'"event": "{e}"' in text for e in events)

    for handler in logging.getLogger(liblog.ROOT).handlers:
        handler.addFilter(keep)


def _check_endpoint(addr: str, flag: str) -> None:
    """ZeroMQ's own parser decides: an address it cannot connect to is a usage error."""
    import zmq

    from messages.link import address_hint

    sock: zmq.SyncSocket = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(addr)
    except zmq.ZMQError as exc:
        _usage(f"{flag} {addr!r} is not a ZeroMQ address ({exc}); {address_hint(addr)}")
    finally:
        sock.close(linger=0)


def _check_bind(addr: str, flag: str) -> None:
    """A bind address without a scheme (`127.0.0.1:5555`) is a usage error naming the one
    meant, before the daemon takes any state (`tcp://*:5555` binds but cannot be connected
    to, so ZeroMQ's connect is no judge here)."""
    from messages.link import address_hint

    if addr and addr != "off" and "://" not in addr:
        _usage(f"{flag} {addr!r} is not a ZeroMQ address (no scheme); {address_hint(addr, bind=True)}")


def _client_keys(directory: Optional[Path], name: str) -> ClientKeys | None:
    if directory is None:
        return None
    from messages.keys import KeysError, client_keys

    try:
        return client_keys(directory, name)
    except KeysError as exc:
        _config_error(exc)


def _parse_kv(items: list[str]) -> JsonObject:
    out: JsonObject = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--vllm-arg expects KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out
