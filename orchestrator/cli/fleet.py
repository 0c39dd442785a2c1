"""`weightsync status` and `abort`: what the daemon holds, and ending a sync by hand."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from messages.errors import WeightSyncError
from orchestrator.cli.tables import history_table, out_console, status_table
from orchestrator.cli.util import (
    EXIT_INTERRUPTED,
    Addr,
    KeyName,
    TrainerKeys,
    _client,
    _fail,
)
from orchestrator.daemon.config import (
    DEFAULT_ADDR,
)


def status(
    addr: Addr = DEFAULT_ADDR,
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
    watch: Optional[float] = typer.Option(None, min=0.1, help="refresh every N seconds"),
    timeout: float = typer.Option(5.0, min=0.1, help="seconds to wait for the daemon"),
    keys: TrainerKeys = None,
    key_name: KeyName = "trainer",
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


def abort(
    sync_id: Optional[str] = typer.Option(None, help="the sync to end (default: the running one)"),
    reason: str = typer.Option("no reason given", help="recorded in status and the journal"),
    addr: Addr = DEFAULT_ADDR,
    timeout: float = typer.Option(10.0, min=0.1, help="seconds to wait for the daemon"),
    as_json: bool = typer.Option(False, "--json"),
    keys: TrainerKeys = None,
    key_name: KeyName = "trainer",
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
