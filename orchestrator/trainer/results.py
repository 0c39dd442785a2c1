"""What a push hands back: `SyncResult` (built by `sync_result` from the stream's and the
finish reply's figures), and the errors of a sync that ended under the push.

Rules: a result is made only from what the daemon answered READY (`FinishReply`) and what
this trainer measured; the engines' and the finish's fields are plain JSON. A sync that
ended before this trainer's finish is raised as its own failure (`ended_cause`), never as
the INVALID_STATE the late finish got; an abort names what made the trainer give up
(`abort_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from messages.buckets import Digester
from messages.errors import ErrorCode, WeightSyncError, make_error
from messages.replies import BeginReply, FinishReply, JsonObject
from messages.replies import body as reply_body
from orchestrator.trainer.stream import Streamed


@dataclass(frozen=True, slots=True)
class SyncResult:
    sync_id: str
    version: int
    buckets: int
    bytes: int
    seconds: float
    engines: list[JsonObject]  # each participant's EngineFinal, as JSON
    digest: str
    state: str = "READY"
    retries: int = 0
    # the finish reply's fields and this push's figures: JSON, read by name
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Bytes per second, end to end (first begin to READY)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def sync_result(
    sync_id: str,
    version: int,
    seconds: float,
    *,
    started: BeginReply,
    streamed: Streamed,
    done: FinishReply,
    digester: Digester,
    trainer_phases: dict[str, float],
    bucket_bytes: int,
    source: tuple[int, int],
) -> SyncResult:
    """A READY push's result; `source` (rank, world): a sharded push's digest is the
    version's (every source's tensors), this source's own is in `detail`."""
    rank, world = source
    return SyncResult(
        sync_id=sync_id,
        version=version,
        buckets=streamed.buckets,
        bytes=streamed.nbytes,
        seconds=seconds,
        engines=[reply_body(e) for e in done.engines],
        digest=done.digest if world > 1 else digester.hexdigest(),
        state=done.status,
        retries=streamed.retries,
        detail={
            **reply_body(done),
            "transport": started.transport,
            "trainer_phases": trainer_phases,
            "trainer_pass_bytes": streamed.pass_bytes,
            "window": streamed.window,
            "bucket_bytes": bucket_bytes,  # as cut (within the daemon's cap: begin reply)
            **(
                {"source": rank, "sources": world, "source_digest": digester.hexdigest()} if world > 1 else {}
            ),
        },
    )


def ended_cause(err: WeightSyncError, sync_id: str) -> WeightSyncError | None:
    """The failure of a sync that ended before this trainer's finish (another source of a
    sharded push failed it, or an engine did once every bucket here was acknowledged): the
    daemon refuses such a finish INVALID_STATE, naming the sync's own code and reason."""
    code = err.details.get("ended_code") if err.code is ErrorCode.INVALID_STATE else None
    if code not in ErrorCode.__members__:
        return None
    return make_error(
        ErrorCode(code),
        f"sync {sync_id!r} ended before this trainer's finish: {err.details.get('ended_reason')}",
        state=err.state,
        version=err.version,
        sync_id=sync_id,
    )


def abort_reason(cause: BaseException) -> tuple[ErrorCode | None, str]:
    """The code (None: ABORTED) and the reason of the abort `cause` makes a trainer send."""
    if isinstance(cause, WeightSyncError):
        code, why = cause.code, f"{cause.code.value}: {cause.message}"
    elif isinstance(cause, KeyboardInterrupt):
        code, why = None, "interrupted (Ctrl-C or SIGTERM)"
    else:
        code, why = None, f"{type(cause).__name__}: {cause}".rstrip(": ")
    return code, f"trainer error: {why}"[:500]
