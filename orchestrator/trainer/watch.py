"""Pushing the checkpoints a trainer writes to disk (prime-rl's filesystem mode, slime's
disk mode, NeMo-style step directories): each complete step directory under a folder,
as its version, in order, once.

Rules:
- A step directory's version comes from its name: the last run of digits
  (`step-120` -> 120), or the one group of `version_from`. Other entries are ignored.
- It is complete when its marker file exists (`marker`, e.g. prime-rl's `STABLE`), or,
  without a marker, when its safetensors are whole: every shard its index
  (`*.safetensors.index.json`) names is present, every file's header reads, and no file
  changed size or time between two scans `settle` seconds apart.
- Complete directories are pushed in version order. One that was there at the first
  scan with a version the fleet serves already is skipped (a restarted watcher pushes
  nothing twice); one completed later whose version is not newer than the newest served
  or pushed (the steps went backwards) is refused with STALE_VERSION, never pushed. A push that fails is reported and tried again at a
  later scan, at most `retries` times.
- With `delta`, each push sends what changed since the previous one (engines need
  `--delta-base`); after a restart the checkpoint of the served version, if still on
  disk, is the base.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from messages.checkpoint import Checkpoint, CheckpointError, iter_safetensors
from messages.errors import ErrorCode, WeightSyncError

DIGITS = re.compile(r"(\d+)(?!.*\d)")


@dataclass
class Step:
    path: Path
    version: int
    seen: tuple[tuple[str, int, int], ...] | None = None  # (file, size, mtime_ns) at the last scan
    seen_at: float = 0.0
    failures: int = 0
    preexisting: bool = False  # there at the watcher's first scan (served before a restart?)


@dataclass
class Watcher:
    """Scans `root` and pushes through `client` (a TrainerClient); `emit` receives one
    event dict per step taken (pushed, skipped, refused, failed, gave_up)."""

    root: Path
    client: Any
    emit: Callable[[dict[str, Any]], None]
    marker: str | None = None
    version_from: re.Pattern[str] | None = None
    settle: float = 1.0
    retries: int = 3
    delta: bool = False
    push_options: dict[str, Any] = field(default_factory=dict)
    steps: dict[Path, Step] = field(default_factory=dict)
    pushed: int | None = None  # the newest version this watcher pushed (or found served)
    done: set[Path] = field(default_factory=set)  # pushed, skipped, refused or given up
    scans: int = 0

    def version_of(self, name: str) -> int | None:
        if self.version_from is not None:
            m = self.version_from.fullmatch(name)
            return int(m.group(1)) if m and m.group(1) and m.group(1).isdigit() else None
        m = DIGITS.search(name)
        return int(m.group(1)) if m else None

    def scan(self, now: float) -> list[Step]:
        """The step directories complete at `now`, in version order."""
        ready = []
        self.scans += 1
        for p in sorted(self.root.iterdir()) if self.root.is_dir() else ():
            if p in self.done or not p.is_dir() or p.name.startswith("."):
                continue
            v = self.version_of(p.name)
            if v is None:
                continue
            step = self.steps.setdefault(p, Step(p, v, preexisting=self.scans == 1))
            if self._complete(step, now):
                ready.append(step)
        return sorted(ready, key=lambda s: s.version)

    def _complete(self, step: Step, now: float) -> bool:
        if self.marker is not None:
            return (step.path / self.marker).exists()
        files = sorted(f for f in step.path.iterdir() if f.is_file())
        try:
            snapshot = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        except OSError:
            return False  # a file went away mid-scan
        if snapshot != step.seen:
            step.seen, step.seen_at = snapshot, now
            return False
        if now - step.seen_at < self.settle:
            return False
        return _whole(step.path)

    def served(self) -> int | None:
        served: int | None = self.client.fleet().last_ready_version
        return served

    def run_once(self, now: float | None = None) -> None:
        """One scan: push every step directory complete now, in order."""
        for step in self.scan(time.monotonic() if now is None else now):
            served = self.served()
            newest = max((v for v in (served, self.pushed) if v is not None), default=None)
            if newest is not None and step.version <= newest:
                if step.preexisting and served is not None and step.version <= served:
                    why = f"version {step.version} is not newer than served {served}"
                    self._end(step, "skipped", reason=why)
                else:  # written after a newer version: the trainer's steps went backwards
                    why = (
                        f"version {step.version} was completed after version {newest} "
                        f"(out of order); nothing pushed"
                    )
                    self._end(step, "refused", code=ErrorCode.STALE_VERSION.value, reason=why)
                continue
            self._push(step, served)

    def _push(self, step: Step, served: int | None) -> None:
        try:
            if self.delta:
                self._adopt_base(served)
            r = self.client.push(Checkpoint(step.path), step.version, delta=self.delta, **self.push_options)
        except (WeightSyncError, CheckpointError) as err:
            step.failures += 1
            code = err.code.value if isinstance(err, WeightSyncError) else "BAD_CHECKPOINT"
            reason = err.message if isinstance(err, WeightSyncError) else str(err)
            given_up = step.failures >= self.retries or isinstance(err, CheckpointError)
            if given_up:
                self._end(step, "gave_up", code=code, reason=reason, attempts=step.failures)
            else:
                self.emit(_event("failed", step, code=code, reason=reason, attempts=step.failures))
            return
        self.pushed = step.version
        self.done.add(step.path)
        extra = {"delta": r.detail["delta"]} if "delta" in r.detail else {}
        self.emit(
            _event(
                "pushed",
                step,
                state=r.state,
                sync_id=r.sync_id,
                buckets=r.buckets,
                bytes=r.bytes,
                seconds=round(r.seconds, 4),
                digest=r.digest,
                transport=r.detail.get("transport"),
                **extra,
            )
        )

    def _adopt_base(self, served: int | None) -> None:
        """After a restart the client keeps no copy: the served version's checkpoint is it."""
        base = self.client.delta_base
        if base.version is not None or served is None:
            return
        for p, s in self.steps.items():
            if s.version == served and p.is_dir():
                try:
                    base.adopt(iter_safetensors(p), served)
                except CheckpointError:
                    return
                return

    def _end(self, step: Step, what: str, **fields: Any) -> None:
        self.done.add(step.path)
        self.emit(_event(what, step, **fields))

    def run(self, poll: float, stop: Callable[[], bool]) -> None:
        while not stop():
            self.run_once()
            if stop():
                return
            time.sleep(poll)


def _event(what: str, step: Step, **fields: Any) -> dict[str, Any]:
    return {"event": what, "version": step.version, "path": str(step.path), **fields}


def _whole(path: Path) -> bool:
    """Every shard the index names is there and every safetensors header reads."""
    for index in path.glob("*.safetensors.index.json"):
        try:
            names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return False
        if not all((path / n).is_file() for n in names):
            return False
    try:
        iter_safetensors(path)  # opens every header; a truncated file is refused
    except CheckpointError:
        return False
    return True
