"""What runs once a sync's buckets are in, on the applier thread: the engine's post-load
step (`finalize`, once per sync), the label of a version committed fleet-wide (`commit`),
the hand-over to readers of a version the daemon serves (`served`), and a fresh digest
outside any sync (`rehash`).

Rules: each takes the engine, the message and the applier's `emit` (its reports go out
through it, in the applier's order; nothing here touches a socket or a queue). The fault injections of
a finalize (a slow post-load step, weights dropped after serving, a second finalize) live
here beside the step they break.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import structlog

from engines.base import (
    DropsWeights,
    Engine,
    HandsToReaders,
    LabelsOutputs,
    RehashesWeights,
    ReportsPhases,
    TakesSlices,
)
from engines.delta import BaseStore
from messages import schema
from messages.errors import ErrorCode, WeightSyncError

if TYPE_CHECKING:
    from engines.prefetch import Prefetcher

log = structlog.get_logger()
# the applier's: a report to the worker (a message for its Session, or a rehash's answer), which it wakes
Emit: TypeAlias = "Callable[[schema.Message | Rehashed], None]"


@dataclass(frozen=True, slots=True)
class Rehash:
    """A job outside any sync: read the weights the engine holds and digest them again
    (`RehashesWeights`), in order after every job queued before it."""

    asked: int  # the worker's count of requests, echoed in the answer


@dataclass(frozen=True, slots=True)
class Rehashed:
    """The answer to `Rehash`: the fresh digest, or why there is none."""

    asked: int
    digest: str | None
    seconds: float
    error: str | None = None


def rehash(engine: Engine, job: Rehash, emit: Emit) -> None:
    t0 = time.perf_counter()
    if not isinstance(engine, RehashesWeights):
        emit(Rehashed(job.asked, None, 0.0, f"a {engine.describe().backend} engine cannot rehash"))
        return
    try:
        digest = engine.fresh_digest()
    except Exception as exc:  # weights mid-load or an engine bug: the answer says which
        log.exception("rehash_failed")
        emit(Rehashed(job.asked, None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"))
        return
    emit(Rehashed(job.asked, digest, time.perf_counter() - t0))


def finalize(
    engine: Engine,
    msg: schema.Finalize,
    emit: Emit,
    *,
    phases: dict[str, float],
    pass_bytes: dict[str, int],
    base: BaseStore,
    prefetcher: Prefetcher | None,
    failpoints: dict[str, float],
) -> None:
    """Run the post-load step and the canaries; the report carries the sync's phases
    (`phases`, `pass_bytes`: what the loads took) and the engine's own split."""
    t0 = time.perf_counter()
    if failpoints.get("finalize_sleep"):  # fault injection: a slow post-load step
        time.sleep(failpoints["finalize_sleep"])
    if isinstance(engine, TakesSlices):
        engine.expect_digest(msg.digest)
    digest = engine.finalize(msg.sync_id)
    base.commit()  # what this sync loaded is the base of the next delta
    if prefetcher is not None:  # the groups kept open: this sync's, one per source
        prefetcher.keep_used(msg.sync_id)
    t1 = time.perf_counter()
    probes = engine.probe(msg.probes) if msg.probes else ()
    seconds = time.perf_counter() - t0
    done = {**phases, "finalize": t1 - t0, "canary": seconds - (t1 - t0)}
    if isinstance(engine, ReportsPhases):
        done.update(engine.last_phases)  # the engine's own split
    rank_digests, rank_received = engine.rank_report() if isinstance(engine, TakesSlices) else ((), ())
    emit(
        schema.Finalized(
            sync_id=msg.sync_id,
            version=msg.version,
            digest=digest,
            finalize_count=engine.finalize_count,
            probes=probes,
            seconds=seconds,
            phases=done,
            pass_bytes=dict(pass_bytes),
            delta=base.held if base.enabled else None,
            rank_digests=rank_digests,
            rank_received=rank_received,
        )
    )
    log.info(
        "engine_finalized",
        sync_id=msg.sync_id,
        version=msg.version,
        digest=digest,
        finalize_count=engine.finalize_count,
        seconds=round(seconds, 4),
    )
    drop_after = failpoints.get("drop_weights_after")
    if drop_after == engine.finalize_count and isinstance(engine, DropsWeights):
        engine.drop_weights()  # fault injection: the weights lost after serving them
    if failpoints.get("finalize_twice"):  # fault injection: the bug the guard stops,
        engine.finalize(msg.sync_id)  # after the first finalize's digest was reported


def commit(engine: Engine, msg: schema.Commit, emit: Emit) -> None:
    """The version is committed fleet-wide: label the outputs with it."""
    if not isinstance(engine, LabelsOutputs):
        raise WeightSyncError("commit to an engine that does not label its outputs", code=ErrorCode.INTERNAL)
    label = engine.set_label(str(msg.version))
    emit(schema.Committed(sync_id=msg.sync_id, version=msg.version, label=label))
    log.info("engine_labelled", sync_id=msg.sync_id, version=msg.version, label=label)


def served(engine: Engine, msg: schema.Served) -> None:
    """The daemon made `version` its served version (durably): readers may have it."""
    if not isinstance(engine, HandsToReaders):
        return  # a notice this engine did not ask for (it registered without served_notice)
    offered = engine.serve(msg.version, msg.digest)
    log.info(
        "version_served" if offered else "served_notice_ignored",
        sync_id=msg.sync_id,
        version=msg.version,
        digest=msg.digest,
    )
