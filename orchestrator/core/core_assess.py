"""What an event brings: the `assess_<trigger>` steps of the core (its `prepare_event`).

Rules: each reads the event and the core's records and writes its findings into the
event's kwargs (an `error` a failing row will close the sync with, `valid`, `lost`); it
changes no record, so a refused event leaves the core exactly as it was. Bound into
`fsm.Core`'s class body.
"""

from __future__ import annotations

from typing import Any

from transitions import EventData

from messages.errors import ErrorCode, WeightSyncError
from orchestrator.core import events as ev
from orchestrator.core import syncs
from orchestrator.core.records import EngineState, SyncRecord

E = EngineState


def assess_register(self: Any, e: EventData, event: ev.EngineRegistered) -> None:
    m, old, s = event.msg, self.engines.get(event.msg.engine_id), self.sync
    if old is not None and s is not None and m.engine_id in s.participants and old.state != E.LOST:
        # The same id registering mid-sync: the process restarted and lost its buckets.
        e.kwargs["error"] = self._error(ErrorCode.ENGINE_FAILED,
                                        f"engine {m.engine_id} re-registered during the sync",
                                        engine_id=m.engine_id)

def assess_finalized(self: Any, e: EventData, event: ev.EngineFinalized) -> None:
    s, eid, m = self.sync, event.engine_id, event.msg
    if s is None or self._participant(eid, m.sync_id) is None or eid in s.finalized:
        return
    if m.version != s.version:
        e.kwargs["error"] = self._error(ErrorCode.ENGINE_FAILED, f"engine {eid} finalized version "
                                        f"{m.version}, expected {s.version}", engine_id=eid)
        return
    want = s.expected_digest or (next(iter(s.finalized.values())).digest if s.finalized else None)
    if want is not None and m.digest != want:
        e.kwargs["error"] = self._error(ErrorCode.ENGINE_FAILED, f"engine {eid} holds digest "
                                        f"{m.digest}, expected {want}", engine_id=eid,
                                        digest=m.digest, expected=want)
        return
    mismatch = syncs.canary_mismatch(s.probes, m.probes)
    if mismatch is not None:
        idx, pos, got, exp = mismatch
        e.kwargs["error"] = self._error(ErrorCode.CANARY_MISMATCH,
                                        f"engine {eid}: probe {idx} differs at position {pos} "
                                        f"(got {got}, expected {exp})", engine_id=eid, probe=idx,
                                        position=pos, got=got, expected=exp)
        return
    e.kwargs["valid"] = True

def assess_failed(self: Any, e: EventData, event: ev.EngineFailed) -> None:
    m = event.msg
    if self.catchups.get(event.engine_id) is not None or m.duplicate:
        return  # a catch-up's failure, or the engine's finalize guard speaking
    if self._participant(event.engine_id, m.sync_id) is None:
        return
    code = ErrorCode(m.code) if m.code in ErrorCode.__members__ else ErrorCode.ENGINE_FAILED
    e.kwargs["error"] = self._error(code, f"engine {event.engine_id} failed: {m.message}",
                                    engine_id=event.engine_id, seq=m.seq)

def assess_tick(self: Any, e: EventData, event: ev.Tick) -> None:
    lim, now, s = self.limits, self.now, self.sync
    lost = [x.engine_id for x in self.engines.values()
            if x.state != E.LOST and now - x.last_seen > lim.engine_timeout]
    e.kwargs["lost"] = lost
    if s is None:
        return
    gone = [x for x in lost if x in s.participants]
    if gone:  # whatever the state: a participant is gone
        err = self._error(ErrorCode.ENGINE_FAILED, f"engine(s) {gone} lost: disconnected, or "
                          f"no heartbeat for {lim.engine_timeout}s", engine_ids=gone)
        e.kwargs["loading_error"] = e.kwargs["finalizing_error"] = err
        return
    err = self._loading_deadline(s)
    if err is not None:
        e.kwargs["loading_error"] = err
    if s.finalize_started is not None and now - s.finalize_started > lim.finalize_timeout:
        slow = sorted(set(s.participants) - set(s.finalized))
        e.kwargs["finalizing_error"] = self._error(ErrorCode.TIMEOUT, f"finalize not reported "
                                                   f"within {lim.finalize_timeout}s by {slow}",
                                                   engine_ids=slow)

def _loading_deadline(self: Any, s: SyncRecord) -> WeightSyncError | None:
    lim, now = self.limits, self.now
    late = [k for k, b in s.buckets.items() if not b.done and now - b.forwarded_at > lim.bucket_timeout]
    if late:
        slow = sorted(set(s.participants) - s.buckets[late[0]].acked_by)
        return self._error(ErrorCode.TIMEOUT, f"bucket seq {late[0][1]} not applied within "
                           f"{lim.bucket_timeout}s by {slow}", engine_ids=slow)
    if s.trainer_lost_at is not None and now - s.trainer_lost_at >= lim.trainer_grace:
        return self._error(ErrorCode.ABORTED, f"the trainer's connection closed "
                           f"{now - s.trainer_lost_at:.1f}s ago mid-sync (it exited or was "
                           f"killed); sync abandoned", trainer_lost=True)
    if now - s.last_activity > lim.sync_timeout:
        return self._error(ErrorCode.TIMEOUT, f"no trainer message for {lim.sync_timeout}s")
    return None

def assess_abort(self: Any, e: EventData, event: ev.AbortSync) -> None:
    e.kwargs["error"] = self._error(ErrorCode.ABORTED,
                                    f"sync aborted by trainer: {event.reason or 'no reason'}")

def assess_internal(self: Any, e: EventData, event: ev.InternalError) -> None:
    e.kwargs["error"] = self._error(ErrorCode.INTERNAL, event.reason)

def assess_shutdown(self: Any, e: EventData, event: ev.Shutdown) -> None:
    e.kwargs["error"] = self._error(ErrorCode.INTERNAL, "daemon shutting down")

