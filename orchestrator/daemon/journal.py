"""SQLite (WAL) record of every sync and every state transition.

Rules: one writer (the service's loop); every transition row is committed before the
service acts on it, so a crash leaves a journal that says what was in flight. `recover()`
turns "a sync was running when the daemon died" into IDLE with dirty=true. A READY row
records its digest with the digest's scheme (`messages.checksums.DIGEST_SCHEME`); a row
from before the scheme was recorded reads as `UNRECORDED_DIGEST_SCHEME`.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

from messages.checksums import UNRECORDED_DIGEST_SCHEME
from messages.replies import JsonObject

SCHEMA = """
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL, wall REAL NOT NULL,
    src TEXT NOT NULL, dst TEXT NOT NULL, trigger TEXT NOT NULL,
    version INTEGER, sync_id TEXT, code TEXT, reason TEXT, dirty INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS syncs (
    sync_id TEXT PRIMARY KEY, version INTEGER NOT NULL, status TEXT NOT NULL,
    digest TEXT, buckets INTEGER, bytes INTEGER, code TEXT, reason TEXT,
    started REAL, ended REAL, ended_by TEXT, digest_scheme TEXT
);
"""
# Columns added since a journal's first version, created on open where missing.
ADDED_COLUMNS = {"syncs": {"ended_by": "TEXT", "digest_scheme": "TEXT"}}

ACTIVE = ("LOADING_BUCKETS", "FINALIZING")


@dataclass(frozen=True, slots=True)
class Recovered:
    state: str  # IDLE or READY
    version: int | None  # last READY version
    digest: str | None
    digest_scheme: str | None  # what made `digest` (None with no digest)
    dirty: bool
    interrupted: str | None  # sync_id that a crash cut short
    history: list[JsonObject]


class SyncRow(TypedDict):
    """One sync as the journal records it (`Journal.syncs`)."""

    sync_id: str
    version: int
    status: str
    digest: str | None
    buckets: int | None
    bytes: int | None
    code: str | None
    reason: str | None
    started: float | None
    ended: float | None


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        for table, columns in ADDED_COLUMNS.items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def close(self) -> None:
        self.db.close()

    def transition(self, entry: JsonObject, dirty: bool) -> None:
        self.db.execute(
            "INSERT INTO transitions (at, wall, src, dst, trigger, version, sync_id, code, reason, dirty)"
            " VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                entry["at"],
                time.time(),
                entry["from"],
                entry["to"],
                entry["trigger"],
                entry.get("version"),
                entry.get("sync_id"),
                entry.get("code"),
                entry.get("reason"),
                int(dirty),
            ),
        )

    def sync(self, data: JsonObject) -> None:
        status = data["status"]
        if status == "LOADING_BUCKETS":
            self.db.execute(
                "INSERT OR REPLACE INTO syncs (sync_id, version, status, started) VALUES (?,?,?,?)",
                (data["sync_id"], data["version"], status, time.time()),
            )
        else:
            self.db.execute(
                "UPDATE syncs SET status=?, digest=?, digest_scheme=?, buckets=?, bytes=?, code=?,"
                " reason=?, ended=?, ended_by=? WHERE sync_id=?",
                (
                    status,
                    data.get("digest"),
                    data.get("digest_scheme"),
                    data.get("buckets"),
                    data.get("bytes"),
                    data.get("code"),
                    data.get("reason"),
                    time.time(),
                    data.get("by"),
                    data["sync_id"],
                ),
            )

    def recover(self, history: int = 50) -> Recovered:
        row = self.db.execute(
            "SELECT version, digest, digest_scheme FROM syncs WHERE status='READY'"
            " ORDER BY ended DESC LIMIT 1"
        ).fetchone()
        version, digest = (row[0], row[1]) if row else (None, None)
        scheme = None if digest is None else (row[2] or UNRECORDED_DIGEST_SCHEME)
        last = self.db.execute(
            "SELECT dst, sync_id, dirty FROM transitions ORDER BY id DESC LIMIT 1"
        ).fetchone()
        interrupted = None
        if last is None:
            state, dirty = "IDLE", False
        elif last[0] in ACTIVE:
            state, dirty, interrupted = "IDLE", True, last[1]
            self.db.execute(
                "UPDATE syncs SET status='INTERRUPTED', ended=?, ended_by='daemon' WHERE sync_id=?",
                (time.time(), interrupted),
            )
        elif last[0] == "READY":
            state, dirty = "READY", False
        else:
            state, dirty = "IDLE", bool(last[2])
        rows = self.db.execute(
            "SELECT src, dst, trigger, version, sync_id, wall, code, reason FROM transitions"
            " ORDER BY id DESC LIMIT ?",
            (history,),
        ).fetchall()
        hist = [
            {
                "from": r[0],
                "to": r[1],
                "trigger": r[2],
                "version": r[3],
                "sync_id": r[4],
                "at": r[5],
                **({"code": r[6], "reason": r[7]} if r[6] else {}),
            }
            for r in reversed(rows)
        ]
        return Recovered(state, version, digest, scheme, dirty, interrupted, hist)

    def syncs(self, limit: int = 20) -> list[SyncRow]:
        cols = (
            "sync_id",
            "version",
            "status",
            "digest",
            "buckets",
            "bytes",
            "code",
            "reason",
            "started",
            "ended",
        )
        rows = self.db.execute(
            f"SELECT {', '.join(cols)} FROM syncs ORDER BY started DESC LIMIT ?", (limit,)
        ).fetchall()
        # sqlite's rows are untyped: the columns above are SyncRow's
        return cast(list[SyncRow], [dict(zip(cols, r, strict=True)) for r in rows])

    def dump(self) -> str:
        return json.dumps({"syncs": self.syncs(1000)}, indent=2)
