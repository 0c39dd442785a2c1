"""Rich tables for `weightsync status`: the daemon and its engines, recent transitions."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table


def status_table(st: dict[str, Any]) -> Table:
    sync = st.get("sync")
    title = (f"weightsync: [bold]{st['state']}[/bold]  version={st.get('version')}  "
             f"dirty={st.get('dirty')}")
    if sync:
        title += f"  sync={sync['sync_id'][:8]} v{sync['version']} {sync['buckets']} buckets {sync['bytes']} B"
    t = Table(title=title, title_justify="left")
    for col in ("engine_id", "backend", "state", "version", "finalize_count", "digest", "host", "pid"):
        t.add_column(col)
    for e in st.get("engines", []):
        t.add_row(*[str(e.get(c) if c != "digest" or not e.get(c) else e[c][:12])
                    for c in ("engine_id", "backend", "state", "version", "finalize_count",
                              "digest", "host", "pid")])
    return t


def history_table(st: dict[str, Any], n: int = 10) -> Table:
    t = Table(title="recent transitions", title_justify="left")
    for col in ("at", "from", "to", "trigger", "version", "code"):
        t.add_column(col)
    for h in st.get("history", [])[-n:]:
        at = time.strftime("%H:%M:%S", time.localtime(h["at"])) if h.get("at") else ""
        t.add_row(at, h["from"], h["to"], h["trigger"], str(h.get("version")), h.get("code") or "")
    return t
