"""Pushing the checkpoints a trainer writes to disk (prime-rl's filesystem mode, slime's
disk mode, NeMo-style step directories): each complete step directory under a folder,
as its version, in order, once, through daemon restarts.

Rules:
- A step directory's version comes from its name: the number after `step`, `checkpoint`,
  `global_step`, `iter` or `ckpt` (`step-120`, `checkpoint-120`, `global_step_120`,
  NeMo's `...-step=120-consumed_samples=3840.0`, `step-120-bf16` are all 120), else the
  name's one run of digits (`120`, `v120`), or the one group of `version_from`. A name
  with several numbers and none of those words is reported once (`ignored`) and skipped;
  a name without digits is skipped silently. A temporary name (`tmp-*`, `tmp_*`, `*.tmp`:
  HF Trainer writes `tmp-checkpoint-N` and renames it `checkpoint-N`) is never pushed.
- It is complete when its marker file exists (`marker`, e.g. prime-rl's `STABLE`), or,
  without a marker, when its safetensors are whole: every shard its index
  (`*.safetensors.index.json`) names is present, a shard named `*-NNNNN-of-MMMMM` has its
  index (HF writes the index last), every file's header reads, and no file changed size
  or time between two scans `settle` seconds apart. A directory unchanged for `settle`
  seconds that is still not whole is reported (`incomplete`, with the reason) once per
  state of its files, and kept watching.
- Complete directories are pushed in version order. One that was there at the first
  scan with a version the fleet serves already is skipped (a restarted watcher pushes
  nothing twice); one completed later whose version is not newer than the newest served
  or pushed (the steps went backwards) is refused with STALE_VERSION, never pushed.
- Only a refusal counts against a step: a push the daemon refused (or failed on its
  merits) is reported (`failed`) and tried again after a backoff, at most `retries`
  times, then given up. No daemon (UNREACHABLE, no reply), no engines (NO_ENGINES) and a
  push during which the connection to the daemon was lost (a daemon restart) are waits:
  reported once when they begin (`waiting`, again every minute) and when they end
  (`resumed`), retried with a backoff of 0.5 s doubling to 5 s, for at most
  `wait_daemon` seconds in a row (0: forever), after which the wait's error is raised.
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
from typing import TYPE_CHECKING

from messages.checkpoint import Checkpoint, CheckpointError, iter_safetensors
from messages.errors import ErrorCode, WeightSyncError, make_error

if TYPE_CHECKING:
    from messages.replies import Json, JsonObject
    from orchestrator.trainer.client import TrainerClient
    from orchestrator.trainer.options import PushOptions

# The number after a step word; the lookbehind keeps `mystep5` out, the lookahead keeps a
# longer number whole.
STEP_WORD = re.compile(
    r"(?<![a-z])(?:global_step|step|checkpoint|ckpt|iteration|iter)[-_=]?(\d+)(?!\d)", re.I
)
DIGITS = re.compile(r"\d+")
TEMPORARY = re.compile(r"^tmp[-_.]|[-_.]tmp$", re.I)
SHARD = re.compile(r"-\d+-of-(\d+)\.safetensors$")
BACKOFF = (0.5, 5.0)  # first and longest wait between tries (seconds), doubling
REMIND = 60.0  # seconds between `waiting` events of one wait


def version_in(name: str) -> int | None | str:
    """The version a step directory's name gives: an int, None (no digits: not a step), or
    a string saying why the name is ambiguous."""
    words = STEP_WORD.findall(name)
    if words:
        return int(words[-1])
    runs = DIGITS.findall(name)
    if len(runs) == 1:
        return int(runs[0])
    if not runs:
        return None
    return f"several numbers in {name!r} and no step word (step, checkpoint, global_step, iter): use --version-from"


@dataclass
class Step:
    path: Path
    version: int
    seen: tuple[tuple[str, int, int], ...] | None = None  # (file, size, mtime_ns) at the last scan
    seen_at: float = 0.0
    failures: int = 0
    retry_at: float = 0.0  # after a refusal: not tried again before this time
    reported: tuple[tuple[str, int, int], ...] | None = None  # the files an `incomplete` event was about
    preexisting: bool = False  # there at the watcher's first scan (served before a restart?)


@dataclass
class Wait:
    """What the watcher waits for: the daemon (no answer, connection lost) or engines."""

    what: str
    since: float
    said: float
    code: str
    reason: str


def _no_options() -> PushOptions:
    return {}


@dataclass
class Watcher:
    """Scans `root` and pushes through `client` (a TrainerClient); `emit` receives one
    event dict per step taken (pushed, skipped, refused, failed, gave_up, incomplete,
    ignored) and per wait (waiting, resumed)."""

    root: Path
    client: TrainerClient
    emit: Callable[[JsonObject], None]
    marker: str | None = None
    version_from: re.Pattern[str] | None = None
    settle: float = 1.0
    retries: int = 3
    delta: bool = False
    wait_daemon: float = 0.0  # seconds a wait may last before its error is raised; 0: forever
    probe_timeout: float = 5.0  # seconds a status request may take before it counts as no answer
    push_options: PushOptions = field(default_factory=_no_options)
    steps: dict[Path, Step] = field(default_factory=dict)
    pushed: int | None = None  # the newest version this watcher pushed (or found served)
    done: set[Path] = field(default_factory=set)  # pushed, skipped, refused or given up
    ignored: set[Path] = field(default_factory=set)  # names reported once as no version
    scans: int = 0
    waiting: Wait | None = None
    next_try: float = 0.0  # while waiting: no request before this time
    backoff: float = BACKOFF[0]

    def version_of(self, name: str) -> int | None | str:
        if self.version_from is not None:
            m = self.version_from.fullmatch(name)
            return int(m.group(1)) if m and m.group(1) and m.group(1).isdigit() else None
        return version_in(name)

    def scan(self, now: float) -> list[Step]:
        """The step directories complete at `now`, in version order."""
        ready = []
        self.scans += 1
        for p in sorted(self.root.iterdir()) if self.root.is_dir() else ():
            if p in self.done or not p.is_dir() or p.name.startswith(".") or TEMPORARY.search(p.name):
                continue
            v = self.version_of(p.name)
            if isinstance(v, str):
                if p not in self.ignored:
                    self.ignored.add(p)
                    self.emit({"event": "ignored", "version": None, "path": str(p), "reason": v})
                continue
            if v is None:
                continue
            step = self.steps.setdefault(p, Step(p, v, preexisting=self.scans == 1))
            if self._complete(step, now):
                ready.append(step)
        return sorted(ready, key=lambda s: s.version)

    def _complete(self, step: Step, now: float) -> bool:
        if self.marker is not None:
            return (step.path / self.marker).exists()
        try:
            files = sorted(f for f in step.path.iterdir() if f.is_file())
            snapshot = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        except OSError:
            return False  # a file (or the directory: renamed) went away mid-scan
        if snapshot != step.seen:
            step.seen, step.seen_at = snapshot, now
            return False
        if now - step.seen_at < self.settle:
            return False
        problem = _problem(step.path)
        if problem is None:
            return True
        if step.reported != snapshot:  # once per state of its files
            step.reported = snapshot
            self.emit(_event("incomplete", step, reason=problem))
        return False

    def run_once(self, now: float | None = None) -> None:
        """One scan: push every step directory complete now, in order (none while a wait's
        backoff runs; a wait ends the scan)."""
        now = time.monotonic() if now is None else now
        ready = self.scan(now)
        if now < self.next_try:
            return
        for step in ready:
            if now < step.retry_at:
                continue
            served = self._served(now, step)
            if isinstance(served, _Waiting):
                return
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
            if not self._push(step, served, now):
                return

    def _served(self, now: float, step: Step | None = None) -> int | None | _Waiting:
        """The fleet's last READY version, or WAITING when the daemon does not answer."""
        try:
            fleet = self.client.fleet(timeout=self.probe_timeout, retries=0)
        except WeightSyncError as err:
            if not no_answer(err):
                raise
            self._wait("daemon", err, now, step)
            return WAITING
        self._resume(now, "daemon")
        served: int | None = fleet.last_ready_version
        return served

    def _push(self, step: Step, served: int | None, now: float) -> bool:
        """Push `step`; False when the push became a wait (the scan stops there)."""
        lost = self.client.lost_connections
        try:
            if self.delta:
                self._adopt_base(served)
            r = self.client.push(Checkpoint(step.path), step.version, delta=self.delta, **self.push_options)
        except (WeightSyncError, CheckpointError) as err:
            if isinstance(err, WeightSyncError):
                what = self._wait_kind(err, lost)
                if what is not None:
                    self._wait(what, err, now, step)
                    return False
            self._resume(now, "engines")
            step.failures += 1
            code = err.code.value if isinstance(err, WeightSyncError) else "BAD_CHECKPOINT"
            reason = err.message if isinstance(err, WeightSyncError) else str(err)
            given_up = step.failures >= self.retries or isinstance(err, CheckpointError)
            if given_up:
                self._end(step, "gave_up", code=code, reason=reason, attempts=step.failures)
            else:
                step.retry_at = now + min(BACKOFF[0] * 2**step.failures, BACKOFF[1])
                self.emit(_event("failed", step, code=code, reason=reason, attempts=step.failures))
            return True
        self._resume(now, "engines")
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
        return True

    def _wait_kind(self, err: WeightSyncError, lost: int) -> str | None:
        """Whether a failed push is a wait: "engines" (NO_ENGINES), "daemon" (no answer, or
        the connection was lost while it ran: a daemon restart fails a push UNKNOWN_SYNC,
        INVALID_STATE or INTERNAL "shutting down"), or None (a refusal: it counts)."""
        if err.code is ErrorCode.NO_ENGINES:
            return "engines"
        if no_answer(err):
            return "daemon"
        # Ask once: a reply can only come after the monitor showed any drop, so the count
        # read after it covers the whole push; no reply at all is a daemon gone too.
        try:
            self.client.fleet(timeout=self.probe_timeout, retries=0)
        except WeightSyncError as probe:
            if not no_answer(probe):
                raise
        else:
            if self.client.lost_connections == lost:
                return None
        err.message = (
            f"the connection to the daemon was lost during the push ({err.code.value}: {err.message})"
        )
        return "daemon"

    def _wait(self, what: str, err: WeightSyncError, now: float, step: Step | None) -> None:
        w = self.waiting
        if w is not None and w.what != what:
            self._resume(now, w.what)
            w = None
        if w is None:
            w = self.waiting = Wait(what, now, now, err.code.value, err.message)
            self._say("waiting", w, now, step)
        elif now - w.said >= REMIND:
            w.said, w.code, w.reason = now, err.code.value, err.message
            self._say("waiting", w, now, step)
        if self.wait_daemon > 0 and now - w.since >= self.wait_daemon:
            raise make_error(
                err.code,
                f"waited {now - w.since:.0f}s for {_FOR[what]} (limit {self.wait_daemon:g}s): {err.message}",
                state=err.state,
                version=err.version,
            )
        self.next_try = now + self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF[1])

    def _resume(self, now: float, *what: str) -> None:
        w = self.waiting
        if w is None or (what and w.what not in what):
            return
        self.waiting, self.next_try, self.backoff = None, 0.0, BACKOFF[0]
        self._say("resumed", w, now, None)

    def _say(self, what: str, w: Wait, now: float, step: Step | None) -> None:
        event: JsonObject = {
            "event": what,
            "for": w.what,
            "version": step.version if step is not None else None,
            "path": str(step.path) if step is not None else None,
            "waited_s": round(now - w.since, 1),
        }
        if what == "waiting":
            event.update(code=w.code, reason=w.reason)
        self.emit(event)

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

    def _end(self, step: Step, what: str, **fields: Json) -> None:
        self.done.add(step.path)
        self.emit(_event(what, step, **fields))

    def run(self, poll: float, stop: Callable[[], bool]) -> None:
        while not stop():
            self.run_once()
            if stop():
                return
            time.sleep(poll)


class _Waiting:
    """`_served`'s answer when the daemon did not answer (a wait has begun)."""


WAITING = _Waiting()
_FOR = {"daemon": "the daemon", "engines": "engines to register"}


def no_answer(err: WeightSyncError) -> bool:
    """No daemon answered: UNREACHABLE, or this client's own TIMEOUT (a daemon's TIMEOUT
    reply, a sync that timed out, carries the daemon's state)."""
    return err.code is ErrorCode.UNREACHABLE or (err.code is ErrorCode.TIMEOUT and err.state is None)


def _event(what: str, step: Step, **fields: Json) -> JsonObject:
    return {"event": what, "version": step.version, "path": str(step.path), **fields}


def _problem(path: Path) -> str | None:
    """Why `path` is not a whole checkpoint yet (None: it is): a shard its index names is
    missing, a shard named `-of-` has no index yet, or a safetensors header does not read."""
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if not indexes:
        shards = sorted(f.name for f in path.glob("*.safetensors") if SHARD.search(f.name))
        if shards:
            return f"{shards[0]} is a shard but there is no *.safetensors.index.json yet"
    for index in indexes:
        try:
            names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as exc:
            return f"{index.name}: not a readable index ({exc})"
        missing = sorted(n for n in names if not (path / n).is_file())
        if missing:
            return f"{index.name} names {', '.join(missing)}, not there"
    try:
        iter_safetensors(path)  # opens every header; a truncated file is refused
    except CheckpointError as exc:
        return str(exc)
    return None
