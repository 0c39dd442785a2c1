"""`weightsync push` (one checkpoint as one version) and `watch` (each checkpoint a trainer
writes, in order): the trainer's side, from the command line."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from messages.errors import ErrorCode, WeightSyncError
from messages.schema import DEFAULT_BUCKET_BYTES
from orchestrator.cli.tables import push_progress
from orchestrator.cli.util import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SYNC,
    Addr,
    BucketBytes,
    KeyName,
    SegmentDir,
    TrainerKeys,
    _client,
    _fail,
    _settings,
    _usage,
    err_console,
    quiet_log_events,
    transport_name,
)
from orchestrator.daemon.config import (
    DEFAULT_ADDR,
)

if TYPE_CHECKING:
    from messages.replies import JsonObject
    from messages.schema import Probe
    from orchestrator.trainer.client import TrainerClient

INT63 = 2**63 - 1


def _read_probes(path: Path) -> list[Probe]:
    """A probes file, checked against the wire schema (the constraints the daemon applies)."""
    import msgspec

    from messages.schema import Probe

    try:
        return msgspec.json.decode(path.read_bytes(), type=list[Probe])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        _usage(f"--probes {path}: {exc}")
        return []


def push(
    checkpoint: Path = typer.Argument(
        ..., exists=True, file_okay=False, help="directory of *.safetensors files"
    ),
    version: int = typer.Option(..., min=0, max=INT63, help="version number (must be newer than served)"),
    addr: Addr = DEFAULT_ADDR,
    bucket_bytes: BucketBytes = DEFAULT_BUCKET_BYTES,
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
        "",
        help="a group transport: this host's address for the group's store [default: the route to the daemon]",
    ),
    partial: bool = typer.Option(
        False, "--partial", help="the checkpoint is a subset of the engines' tensors on purpose"
    ),
    engines_wait: float = typer.Option(
        0.0, min=0.0, help="seconds to wait for engines to register (default: fail at once)"
    ),
    shm_dir: SegmentDir = None,
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
    keys: TrainerKeys = None,
    key_name: KeyName = "trainer",
) -> None:
    """Push a safetensors checkpoint to every engine as VERSION."""
    import signal

    from messages import segments
    from messages.checkpoint import Checkpoint, CheckpointError, iter_safetensors

    segments.configure(_settings(shm_dir=shm_dir).shm_dir)
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


def watch(
    directory: Path = typer.Argument(
        ..., file_okay=False, help="folder the trainer writes step directories into"
    ),
    addr: Addr = DEFAULT_ADDR,
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
    bucket_bytes: BucketBytes = DEFAULT_BUCKET_BYTES,
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
    keys: TrainerKeys = None,
    key_name: KeyName = "trainer",
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
    bad: list[JsonObject] = []

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

    def on_signal(*_: object) -> None:
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


def _settle(c: TrainerClient, err: WeightSyncError, wait: float) -> None:
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
