"""Why the table took no row for an event: the typed error the sender gets.

Rules: called only after the core refused an event, so nothing has changed; reads the
core's records, never changes them. Each refusal names its cause: the sync that ended
and how, the sync or rollback in the way, the field out of range, the tensors missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from messages.errors import ErrorCode, WeightSyncError
from messages.schema import Bucket
from orchestrator.core import events as ev
from orchestrator.core import syncs

if TYPE_CHECKING:
    from orchestrator.core.records import SyncRecord


class Explain:
    """Mixed into the core (fsm.Core): `explain(event)` and the checks it shares with it."""

    def explain(self: Any, event: ev.Event) -> WeightSyncError:
        fn = getattr(self, "_why_" + event.TRIGGER, None)
        err = fn(event) if fn is not None else None
        return err or self._error(ErrorCode.INVALID_STATE,
                                  f"{event.TRIGGER} is not allowed in state {self.state.value}")

    # -- one per trainer trigger ----------------------------------------------------------
    def _why_begin(self: Any, event: ev.BeginSync) -> WeightSyncError:
        m, s = event.msg, self.sync
        if s is not None and s.kind == "rollback":
            return self._error(ErrorCode.INVALID_STATE,
                               f"the daemon is rolling the engines back to version {s.version} "
                               f"after a failed sync; retry when it is READY", rollback_running=True)
        if s is not None and s.sync_id == m.sync_id:
            return self._error(ErrorCode.BAD_MESSAGE, f"sync {m.sync_id!r} was begun with version {s.version}")
        if s is not None:
            age = self.now - s.started_at
            return self._error(ErrorCode.INVALID_STATE,
                               f"begin is not allowed in state {self.state.value}: sync {s.sync_id!r} "
                               f"(version {s.version}) has been running for {age:.0f}s; wait for it, "
                               f"or end it with `weightsync abort --sync-id {s.sync_id}`",
                               running_sync_id=s.sync_id, running_version=s.version,
                               running_seconds=round(age, 3))
        if m.sync_id in self.ended:
            return self._error(ErrorCode.BAD_MESSAGE, f"sync_id {m.sync_id!r} was used by an earlier "
                               f"sync; every begin needs a new sync_id")
        if self.last_ready_version is not None and m.version <= self.last_ready_version:
            return self._error(ErrorCode.STALE_VERSION, f"version {m.version} is not newer than "
                               f"served version {self.last_ready_version}")
        return self._error(ErrorCode.NO_ENGINES, f"{len(self.live_engines())} engine(s) registered, "
                           f"{self.limits.min_engines} required")

    def _why_bucket(self: Any, event: ev.BucketIn) -> WeightSyncError:
        m = event.msg
        s = self.require_sync(m.sync_id, "bucket")
        if not self.allows("bucket"):
            return self._error(ErrorCode.INVALID_STATE, f"bucket is not allowed in state {self.state.value}")
        if m.sender >= s.senders:
            return self._error(ErrorCode.BAD_MESSAGE, f"sender {m.sender} out of range (senders={s.senders})")
        rec = s.buckets.get((m.sender, m.seq))
        if rec is not None:
            return self._error(ErrorCode.BAD_MESSAGE, f"seq {m.seq} resent with {event.nbytes} bytes, "
                               f"first had {rec.nbytes}")
        return self.spec_refusal(m) or self._error(ErrorCode.INTERNAL, "bucket refused for no reason")

    def _why_finish(self: Any, event: ev.FinishSync) -> WeightSyncError:
        m = event.msg
        if not self.allows("finish") and (self.sync is None or self.sync.sync_id == m.sync_id):
            return self._error(ErrorCode.INVALID_STATE, f"finish is only allowed in LOADING_BUCKETS, "
                               f"state is {self.state.value}{self._ended_note(m.sync_id)}")
        s = self.require_sync(m.sync_id, "finish")
        if m.sender >= s.senders:
            return self._error(ErrorCode.BAD_MESSAGE, f"sender {m.sender} out of range (senders={s.senders})")
        reason = syncs.incomplete_reason(s, {**s.finished, m.sender: m.buckets})
        if reason is not None:
            return self._error(ErrorCode.INCOMPLETE_SYNC, reason)
        eid, names = syncs.missing_tensors(s, self.engines) or ("?", [])
        return self._error(ErrorCode.INCOMPLETE_SYNC,
                           f"engine {eid} would be left with {len(names)} tensor(s) of the old "
                           f"version: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} "
                           f"(send them, or finish with partial=true); nothing was finalized",
                           engine_id=eid, missing=names[:64], missing_count=len(names))

    def _why_abort(self: Any, event: ev.AbortSync) -> WeightSyncError:
        self.require_sync(event.sync_id, "abort")
        return self._error(ErrorCode.INVALID_STATE, f"abort is not allowed in state {self.state.value}")

    # -- shared checks ------------------------------------------------------------------
    def allows(self: Any, trigger: str) -> bool:
        """Whether the table has a row for `trigger` from the current state."""
        return trigger in self.machine.get_triggers(self.state)

    def require_sync(self: Any, sync_id: str, what: str) -> SyncRecord:
        """The running sync `sync_id`, or raise why it is not running: its own failure if it
        ended (the real cause, not the state it left), else UNKNOWN_SYNC."""
        if self.sync is not None and self.sync.sync_id == sync_id:
            return self.sync
        ended = self.ended.get(sync_id)
        if ended is not None:
            code, reason = ended
            if code is None:
                raise self._error(ErrorCode.INVALID_STATE,
                                  f"{what} for sync {sync_id!r}, which already completed (READY)", ended=True)
            raise self._error(ErrorCode(code), f"{what} for sync {sync_id!r}, which already ended: "
                                               f"{reason}", ended=True)
        if self.sync is not None:
            raise self._error(ErrorCode.UNKNOWN_SYNC,
                              f"{what} for sync {sync_id!r}, but sync {self.sync.sync_id!r} is running")
        raise self._error(ErrorCode.UNKNOWN_SYNC,
                          f"{what} for sync {sync_id!r}, which this daemon does not know (it "
                          f"restarted, or the sync never began): begin again")

    def _ended_note(self: Any, sync_id: str) -> str:
        ended = self.ended.get(sync_id)
        if ended is None:
            return ""
        return f" (sync {sync_id!r} " + ("already completed (READY))" if ended[0] is None
                                         else f"already ended: {ended[1]})")

    def spec_refusal(self: Any, msg: Bucket) -> WeightSyncError | None:
        """A bucket some engine would refuse, refused before any engine sees it."""
        s = self.sync
        for eid in s.participants if s else ():
            x = self.engines[eid]
            if not x.spec:
                continue
            for t in msg.tensors:
                spec = x.spec.get(t.name)
                if spec is None:
                    return self._error(ErrorCode.UNKNOWN_TENSOR, f"engine {eid} has no tensor {t.name!r}",
                                       engine_id=eid, tensor=t.name)
                if tuple(spec.shape) != tuple(t.shape) or (not x.cast_ok and spec.dtype != t.dtype):
                    return self._error(ErrorCode.SHAPE_MISMATCH,
                                       f"{t.name}: engine {eid} expects {spec.dtype}{list(spec.shape)}, "
                                       f"bucket has {t.dtype}{list(t.shape)}", engine_id=eid, tensor=t.name)
        return None
