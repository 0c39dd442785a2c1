"""What `weightsync` shows a person: the status tables (daemon, engines, transitions) and
the progress of a push on a terminal."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table

from messages.replies import GROUP_KEY
from orchestrator.daemon.config import columns_set

SUMMARY_AFTER = 16  # a larger fleet is shown grouped by state, version and digest
# Where no width is known (a pipe, a file, no COLUMNS), rows are never cut: a table is only
# as wide as its content, so this is a bound on a line, not a padding.
PIPE_WIDTH = 1000


def out_console() -> Console:
    """stdout for tables: COLUMNS wide when set, a terminal's width on a terminal, and
    whole rows otherwise (grep, logs): rich alone would cut them at 80 columns."""
    if columns_set() or sys.stdout.isatty():
        return Console()  # rich reads COLUMNS, then the terminal's size
    return Console(width=PIPE_WIDTH)


def status_table(st: dict[str, Any]) -> RenderableType:
    """The daemon's line, what serves its version, the engines, and a sharded push's
    sources (one row each; a larger push: the sources not begun or not finished)."""
    engines_table = _engines_table(st)
    sources = _sources_table(st.get("sync"))
    return Group(engines_table, sources) if sources is not None else engines_table


def _served_line(st: dict[str, Any]) -> str:
    """How many engines serve the daemon's version now, and a plain sentence when none do."""
    version, served_by = st.get("version"), st.get("served_by")
    if version is None or served_by is None:  # nothing served, or an older daemon
        return ""
    live = [e for e in st.get("engines", []) if e.get("state") != "LOST"]
    line = f"  served by {served_by} of {len(live)} live engines"
    if served_by == 0 and not st.get("sync"):  # during a sync its participants are not READY
        line += (
            f"\n[bold red]version {version} is not served by any engine[/bold red]"
            " (none is READY at it with its server answering; the next push brings them to a version)"
        )
    return line


def _sources_table(sync: dict[str, Any] | None) -> Table | None:
    sources = (sync or {}).get("sources")
    if not sources:
        return None
    rows = sources
    title = f"sources of sync {sync['sync_id'][:8] if sync else ''} ({len(sources)})"
    if len(sources) > SUMMARY_AFTER:  # a large push: only the sources still owed something
        rows = [s for s in sources if not s.get("begun") or not s.get("finished") or not s.get("connected")]
        title += f", {len(sources) - len(rows)} finished and connected not shown"
        rows = rows[:SUMMARY_AFTER]
    t = Table(title=title, title_justify="left")
    for col in ("source", "begun", "buckets", "bytes", "acked", "finished", "connected"):
        t.add_column(col)
    for s in rows:
        t.add_row(
            str(s.get("source")),
            "yes" if s.get("begun") else "[bold red]never began[/bold red]",
            str(s.get("buckets")),
            str(s.get("bytes")),
            str(s.get("acked")),
            "yes" if s.get("finished") else "no",
            "yes" if s.get("connected") else "[bold red]lost[/bold red]",
        )
    return t


def _state_cell(e: dict[str, Any]) -> str:
    if e.get("server_error"):
        return f"{e.get('state')}, server down"
    return str(e.get("state"))


def _engines_table(st: dict[str, Any]) -> Table:
    sync = st.get("sync")
    title = f"weightsync: [bold]{st['state']}[/bold]  version={st.get('version')}  dirty={st.get('dirty')}"
    title += _served_line(st)
    if sync:
        title += (
            f"  sync={sync['sync_id'][:8]} v{sync['version']} {sync['buckets']} buckets "
            f"{sync['bytes']} B via {sync.get('transport')}"
        )
    scheme = st.get("digest_scheme_error")
    if scheme:  # an older daemon's state database or spool: the operator's next step
        title += f"\n[bold red]{scheme['code']}[/bold red]: {scheme['message']}"
    group = st.get(GROUP_KEY)
    if group:
        title += (
            f"\ncollective group {group['group']}: {group['backend']}, world size "
            f"{group['world_size']}, store {group['store']}"
        )
    engines = st.get("engines", [])
    unhealthy = [e for e in engines if e.get("server_error") and e.get("state") != "LOST"]
    for e in unhealthy[:4]:  # a dead server between syncs: one line each, a few at most
        title += f"\n[bold red]engine {e['engine_id']} is unhealthy[/bold red]: {escape(e['server_error'])}"
    if len(unhealthy) > 4:
        title += f"\n... and {len(unhealthy) - 4} more engines whose server does not answer (status --json)"
    if len(engines) > SUMMARY_AFTER:
        return _fleet_table(title, engines)
    cols = ["engine_id", "backend", "state", "version", "finalize_count", "digest", "host", "pid"]
    ranks: dict[str, str] = {}
    if group:  # each engine's ranks in the group (rank 0 is the trainer)
        cols.append("ranks")
        for eid, m in (group.get("members") or {}).items():
            r, n = int(m["rank"]), int(m["ranks"])
            ranks[eid] = str(r) if n == 1 else f"{r}-{r + n - 1}"
    if any((e.get("slices") or {}).get("received") for e in engines):
        cols.append("slices MB")  # each rank's bytes in its last sync, of a sliced engine
    t = Table(title=title, title_justify="left")
    for col in cols:
        t.add_column(col)
    for e in engines:
        got = (e.get("slices") or {}).get("received")
        row = {
            **e,
            "state": _state_cell(e),
            "digest": (e.get("digest") or "")[:12] or None,
            "ranks": ranks.get(e["engine_id"], "-"),
            "slices MB": "/".join(f"{n / 1e6:.1f}" for n in got) if got else "-",
        }
        t.add_row(*[str(row.get(c)) for c in cols])
    return t


def _fleet_table(title: str, engines: list[dict[str, Any]]) -> Table:
    """One row per (state, version, digest, backend): how many engines, and a few of them."""
    groups: dict[tuple[str, str, str, str], list[str]] = {}
    for e in engines:
        key = (
            _state_cell(e),
            str(e.get("version")),
            (e.get("digest") or "")[:12],
            str(e.get("backend")),
        )
        groups.setdefault(key, []).append(str(e.get("engine_id")))
    t = Table(
        title=f"{title}\n{len(engines)} engines, grouped (the full list: status --json)",
        title_justify="left",
    )
    for col in ("state", "engines", "version", "digest", "backend", "for example"):
        t.add_column(col)
    for (state, version, digest, backend), ids in sorted(
        groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]))
    ):
        sample = ", ".join(sorted(ids)[:3]) + (" ..." if len(ids) > 3 else "")
        t.add_row(state, str(len(ids)), version, digest, backend, sample)
    return t


def history_table(st: dict[str, Any], n: int = 10) -> Table:
    t = Table(title="recent transitions", title_justify="left")
    for col in ("at", "from", "to", "trigger", "version", "code"):
        t.add_column(col)
    for h in st.get("history", [])[-n:]:
        at = time.strftime("%H:%M:%S", time.localtime(h["at"])) if h.get("at") else ""
        t.add_row(at, h["from"], h["to"], h["trigger"], str(h.get("version")), h.get("code") or "")
    return t


@contextlib.contextmanager
def push_progress(checkpoint: Path, version: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on a terminal (bytes acknowledged by every engine, GB/s, ETA); None
    (no output at all) otherwise, e.g. with --json or when stdout is a pipe."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from messages.checkpoint import checkpoint_spec
    from messages.dtypes import ITEMSIZE

    total = 0
    for p in checkpoint_spec(checkpoint).values():
        n = ITEMSIZE[p.dtype]
        for d in p.shape:
            n *= d
        total += n
    columns = (
        TextColumn("[bold]v{task.fields[version]}[/bold] {task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[buckets]} buckets applied by every engine"),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("pushing", total=total, version=version, buckets=0)
        state = {"buckets": 0}

        def advance(nbytes: int) -> None:
            state["buckets"] += 1
            bar.update(task, advance=nbytes, buckets=state["buckets"])

        yield advance
        bar.update(task, description="done")
