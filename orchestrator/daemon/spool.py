"""The spool: the buckets of the last READY version on disk, for rollback and rejoin.

Rules:
- One committed version at rest (`current` -> `v{version}-{sync}`), plus the incoming one
  while a sync streams through (so at most two models on disk, one at rest).
- A delta version is stored as its base's buckets (hard links, no copy) followed by its
  own patches, each bucket tagged with its generation: a replay sends them in order and
  the engine rebuilds each patch on what came before, ending at the full version (its
  digest proves it). The chain is bounded by the daemon (`max_delta_chain`).
- A bucket is written when the daemon forwards it; the incoming directory is fsynced,
  renamed and made `current` before the sync's READY is journaled or answered. Anything
  else (an interrupted sync, an old version) is deleted at startup or on the next commit.
- The manifest records the digest's scheme (`messages.checksums.DIGEST_SCHEME`) beside the
  digest; one written before the scheme was recorded reads as `UNRECORDED_DIGEST_SCHEME`.
  The core replays only a spool of this daemon's scheme (`Model.can_roll_back`).
- A write failure never fails a sync: the spool goes `degraded` for that version (the
  error is in status and the log) and holds nothing that could be replayed as the served
  version. Torch-free: it stores frames and headers, never tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from messages.checksums import DIGEST_SCHEME, UNRECORDED_DIGEST_SCHEME
from messages.replies import JsonObject
from messages.schema import Probe

log = structlog.get_logger()

MANIFEST = "manifest.json"
CURRENT = "current"
LOCK = ".lock"  # orchestrator.daemon.locks: one daemon per spool


@dataclass(frozen=True, slots=True)
class SpoolInfo:
    """What the spool holds: the FSM compares it with the served version and digest."""

    version: int
    digest: str
    sync_id: str
    buckets: int
    nbytes: int
    probes: tuple[Probe, ...] = ()  # the version's canaries (checked again on replay)
    chain: int = 0  # delta generations on top of the last dense version
    scheme: str = DIGEST_SCHEME  # what made `digest` (messages.checksums)
    # a version cut into slices: per layout key, each rank's digest (checked on replay)
    slice_digests: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    source: int
    seq: int
    file: str
    nbytes: int
    checksum: int
    tensors: list[JsonObject]  # the bucket's TensorMeta.to_wire() (JSON in the manifest)
    gen: int = 0  # 0: the dense version; k: the k-th delta on top of it (replayed in order)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Spool:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.info: SpoolInfo | None = None
        self.error: str | None = None
        self._dir: Path | None = None  # the committed version's directory
        self._entries: list[SpoolEntry] = []
        self._incoming: Path | None = None
        self._incoming_sync: str | None = None
        self._incoming_entries: list[SpoolEntry] = []
        self._incoming_failed: str | None = None
        self._gen = 0  # the incoming sync's generation (0 unless it is a delta)
        self._load_current()
        self._sweep()

    # -- reading ------------------------------------------------------------------------
    def _load_current(self) -> None:
        link = self.root / CURRENT
        if not link.is_symlink():
            return
        target = self.root / os.readlink(link)
        try:
            raw = json.loads((target / MANIFEST).read_text())
            entries = [
                SpoolEntry(
                    int(b["source"] if "source" in b else b["sender"]),  # "sender": before protocol v8
                    int(b["seq"]),
                    str(b["file"]),
                    int(b["nbytes"]),
                    int(b["checksum"]),
                    list(b["tensors"]),
                    int(b.get("gen", 0)),
                )
                for b in raw["buckets"]
            ]
            for e in entries:
                if (target / e.file).stat().st_size != e.nbytes:
                    raise ValueError(f"{e.file} has the wrong size")
            self.info = SpoolInfo(
                int(raw["version"]),
                str(raw["digest"]),
                str(raw["sync_id"]),
                len(entries),
                sum(e.nbytes for e in entries),
                tuple(msgspec.convert(raw.get("probes", []), type=list[Probe])),
                max((e.gen for e in entries), default=0),
                msgspec.convert(raw.get("digest_scheme", UNRECORDED_DIGEST_SCHEME), type=str),
                msgspec.convert(raw.get("slice_digests", {}), type=dict[str, tuple[str, ...]]),
            )
            self._dir, self._entries = target, entries
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
            self.error = f"spool at {target} unreadable: {exc}"
            log.warning("spool_unreadable", path=str(target), reason=str(exc))

    def _sweep(self) -> None:
        keep = {self._dir.name} if self._dir else set()
        for p in self.root.iterdir():
            if p.name in (CURRENT, LOCK) or p.name in keep:
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def entries(self) -> list[SpoolEntry]:
        return list(self._entries)

    def entry(self, i: int) -> SpoolEntry:
        """The committed version's bucket `i` (IndexError past the last)."""
        return self._entries[i]

    @property
    def layered(self) -> bool:
        """The version is kept as base + deltas (`SpoolInfo.chain`): a replay's engines keep
        what it loads until it ends (`Load.hold`), so one without a base rebuilds it too."""
        return self.info is not None and self.info.chain > 0

    @property
    def cut_for(self) -> tuple[str, ...]:
        """The layout keys the version's boxes were cut for (`Load.cut_for`; empty: whole)."""
        return tuple(sorted(self.info.slice_digests)) if self.info is not None else ()

    def read(self, entry: SpoolEntry) -> bytes:
        if self._dir is None:
            raise OSError("the spool holds no version")
        return (self._dir / entry.file).read_bytes()

    # -- writing ------------------------------------------------------------------------
    def begin(self, sync_id: str, version: int, base: int | None = None) -> None:
        """Start spooling a sync; `base`: it is a delta on that version, which is linked in
        first (the daemon checked the spool holds it)."""
        self.discard()
        # Named by the daemon, never by a peer's id (a sync_id is only data in the manifest).
        self._incoming = self.root / f"incoming-{uuid.uuid4().hex}"
        self._incoming_sync = sync_id
        self._incoming_entries = []
        self._incoming_failed = None
        self._gen = 0
        try:
            self._incoming.mkdir(parents=True)
            if base is not None:
                if self.info is None or self.info.version != base or self._dir is None:
                    raise OSError(f"the delta's base {base} is not the spooled version")
                for e in self._entries:
                    os.link(self._dir / e.file, self._incoming / e.file)
                self._incoming_entries = list(self._entries)
                self._gen = self.info.chain + 1
        except OSError as exc:
            self.fail(f"{type(exc).__name__}: {exc}")

    def add(
        self,
        sync_id: str,
        source: int,
        seq: int,
        tensors: list[JsonObject],
        checksum: int,
        data: memoryview | bytes,
    ) -> None:
        if self._incoming is None or self._incoming_sync != sync_id or self._incoming_failed:
            return
        name = f"{self._gen:04d}-{source:04d}-{seq:08d}.bin"
        try:
            with open(self._incoming / name, "wb") as fh:
                fh.write(data)
        except OSError as exc:
            self.fail(f"{type(exc).__name__}: {exc}")
            return
        self._incoming_entries.append(
            SpoolEntry(source, seq, name, memoryview(data).nbytes, checksum, tensors, self._gen)
        )

    def fail(self, reason: str) -> None:
        """The incoming version cannot be spooled whole (the sync itself goes on)."""
        if self._incoming_failed is None:
            log.warning("spool_write_failed", sync_id=self._incoming_sync, reason=reason)
        self._incoming_failed = reason

    def commit(
        self,
        sync_id: str,
        version: int,
        digest: str,
        probes: tuple[Probe, ...] = (),
        slice_digests: dict[str, tuple[str, ...]] | None = None,
    ) -> SpoolInfo | None:
        """Make the incoming sync the spooled version (durably), or degrade."""
        if self._incoming is None or self._incoming_sync != sync_id:
            return self.info
        entries = sorted(self._incoming_entries, key=lambda e: (e.gen, e.source, e.seq))
        failed = self._incoming_failed
        if failed is None:
            try:
                manifest = {
                    "version": version,
                    "digest": digest,
                    "digest_scheme": DIGEST_SCHEME,
                    "sync_id": sync_id,
                    "probes": [p.to_wire() for p in probes],
                    "slice_digests": {k: list(v) for k, v in (slice_digests or {}).items()},
                    "buckets": [
                        {
                            "source": e.source,
                            "seq": e.seq,
                            "file": e.file,
                            "nbytes": e.nbytes,
                            "checksum": e.checksum,
                            "tensors": e.tensors,
                            "gen": e.gen,
                        }
                        for e in entries
                    ],
                }
                for e in entries:
                    fd = os.open(self._incoming / e.file, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                with open(self._incoming / MANIFEST, "w") as fh:
                    json.dump(manifest, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                final = self.root / f"v{version:020d}-{self._incoming.name[len('incoming-') :][:12]}"
                os.replace(self._incoming, final)
                tmp_link = self.root / f".{CURRENT}.tmp"
                tmp_link.unlink(missing_ok=True)
                os.symlink(final.name, tmp_link)
                os.replace(tmp_link, self.root / CURRENT)
                _fsync_dir(self.root)
            except OSError as exc:
                failed = f"{type(exc).__name__}: {exc}"
                log.warning("spool_commit_failed", sync_id=sync_id, reason=failed)
            else:
                old = self._dir
                self._dir, self._entries = final, entries
                self.info = SpoolInfo(
                    version,
                    digest,
                    sync_id,
                    len(entries),
                    sum(e.nbytes for e in entries),
                    tuple(probes),
                    max((e.gen for e in entries), default=0),
                    slice_digests=dict(slice_digests or {}),
                )
                self.error = None
                self._incoming = None
                if old is not None and old != final:
                    shutil.rmtree(old, ignore_errors=True)
                log.info(
                    "spool_committed",
                    sync_id=sync_id,
                    version=version,
                    buckets=len(entries),
                    nbytes=self.info.nbytes,
                )
                return self.info
        # The served version is not on disk: drop what is, it can never be replayed as it.
        self.error = f"version {version} not spooled: {failed}"
        self.discard()
        self._drop_current()
        return None

    def _drop_current(self) -> None:
        try:
            (self.root / CURRENT).unlink(missing_ok=True)
        except OSError as exc:  # the spool directory itself is gone or unusable
            log.warning("spool_unusable", path=str(self.root), reason=str(exc))
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir, self._entries, self.info = None, [], None

    def discard(self, sync_id: str | None = None) -> None:
        if self._incoming is None or (sync_id is not None and sync_id != self._incoming_sync):
            return
        shutil.rmtree(self._incoming, ignore_errors=True)
        self._incoming_failed = None
        self._incoming, self._incoming_sync, self._incoming_entries = None, None, []

    def view(self) -> JsonObject:
        i = self.info
        return {
            "path": str(self.root),
            "version": i.version if i else None,
            "digest": i.digest if i else None,
            "digest_scheme": i.scheme if i else None,
            "buckets": i.buckets if i else 0,
            "bytes": i.nbytes if i else 0,
            "error": self.error,
            "state": "ok" if i and not self.error else ("degraded" if self.error else "empty"),
            "chain": i.chain if i else 0,
        }
