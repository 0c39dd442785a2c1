"""Who may speak for a source of a sync: its seat (the token or connection that began
it), the sync's range of sources, and a sharded push's tensor ownership (disjoint parts,
the plan). A second claim or a disagreement fails the sync for every source at once.
"""

from __future__ import annotations

from messages.errors import ErrorCode
from messages.schema import Bucket
from orchestrator.core.model import Model
from orchestrator.core.records import SyncRecord
from orchestrator.core.states import EngineState, State

S, E = State, EngineState


# -- a source's seat ------------------------------------------------------------------------
# Theory of operation: a source's seat (its index in a sync, 0 for a plain push) belongs to
# whoever began it: the begin's `seat` token (a random number the trainer chooses once and
# carries in its buckets and finish), or without one the trainer connection it came on. A
# token survives a reconnect (ZeroMQ gives a reconnected DEALER a new routing identity) and
# a begin resent after a lost reply; a second process does not know it. A begin, bucket or
# finish for a held seat from anyone else is a second claim: it could not be told apart
# from the holder's resend (same seq, same size) and would mix two trainers' bytes, so the
# sync fails for every source at once (nothing of it is committed), and the claimant is
# refused with the same error. A sharded begin that disagrees with the running sharded sync
# (version, sources, plan, or a sync_id begun with another version) ends it the same way:
# its sources could only ever time out waiting for each other.
def claim(seat: int | None, conn: bytes) -> tuple[str, object]:
    return ("seat", seat) if seat is not None else ("conn", conn)


def seat_holder(m: Model, s: SyncRecord, source: int, claim: tuple[str, object], what: str) -> bool:
    """Whether `claim` holds `source`'s seat of `s` (or nobody does: a rollback's own
    requests); otherwise the sync fails for every source (False)."""
    held = s.seats.get(source)
    if held is None or held == claim:
        return True
    by = "a token" if claim[0] == "seat" else "a connection"
    conflict(
        m,
        s,
        source,
        f"was claimed by a second {what} from {by} other than the one that began it (two "
        f"processes push as source {source}: check each rank's source index)",
        None,
        "seat",
    )
    return False


def conflict(m: Model, s: SyncRecord, source: int, what: str, running: str | None, field: str) -> None:
    """The sync fails for every source, each told what disagreed; the input is refused."""
    where = f"sync {s.sync_id!r} (version {s.version}, {s.sources} source(s))"
    sentence = (
        f"source {source} {what}, but {where} runs with {running}"
        if running is not None
        else f"source {source} of {where} {what}"
    )
    tail = (
        "the sync failed for every source and nothing of it was committed"
        if m.state == S.LOADING_BUCKETS
        else "refused (every source has finished: the sync goes on)"
    )
    m.conflict(
        m.error(
            ErrorCode.SOURCE_CONFLICT,
            f"{sentence}; {tail}",
            source=source,
            disagreed=field,
            sync_id_running=s.sync_id,
        )
    )


def check_source(m: Model, s: SyncRecord, source: int) -> None:
    """A bucket or finish comes from one of the sync's sources, once that source began."""
    if source >= s.sources:
        raise m.error(ErrorCode.BAD_MESSAGE, f"source {source} out of range (sources={s.sources})")
    if s.sources > 1 and source not in s.begun:
        raise m.error(
            ErrorCode.BAD_MESSAGE,
            f"source {source} has not begun sync {s.sync_id!r}: begin (version {s.version}, "
            f"sources {s.sources}) first",
        )


def check_owner(m: Model, s: SyncRecord, msg: Bucket) -> None:
    """A sharded push's sources send disjoint parts: a tensor another source already sent
    is refused before any engine sees this bucket (the first source's copy stands). With a
    plan the daemon has seen carried out, a tensor its plan gives another source is refused
    the same way, whether or not that source sent it yet."""
    planned = m.plans.get(s.plan) if s.plan is not None else None
    for t in msg.tensors:
        owner = planned.get(t.name) if planned is not None else None
        if owner is not None and owner != msg.source:
            raise m.error(
                ErrorCode.DUPLICATE_TENSOR,
                f"source {msg.source} sent tensor {t.name!r} (bucket seq {msg.seq}), which plan "
                f"{s.plan} gives source {owner}: every source must send only its own part",
                tensor=t.name,
                source=msg.source,
                other_source=owner,
                plan=s.plan,
            )
        other = s.names.get(t.name)
        if other is not None and other != msg.source:
            raise m.error(
                ErrorCode.DUPLICATE_TENSOR,
                f"source {msg.source} sent tensor {t.name!r} (bucket seq {msg.seq}), which source "
                f"{other} already sent: the sources' parts must be disjoint (the same assignment on "
                f"every rank)",
                tensor=t.name,
                source=msg.source,
                other_source=other,
            )
