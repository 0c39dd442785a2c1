"""Pure questions about one sync's record: is it complete, which tensors are missing, did
the canaries match, how do its buckets travel, what does its summary say. No state
changes here: the core's triggers (sync.py) ask, then decide.
"""

from __future__ import annotations

import dataclasses

from messages import coverage, transports
from messages.replies import SyncSummary
from messages.schema import Begin, Probe
from messages.slices import WHOLE, layout_of
from orchestrator.core.records import EngineRecord, GroupRecord, SyncRecord


def incomplete_reason(s: SyncRecord, finished: dict[int, int]) -> str | None:
    """Why `s` cannot finalize with `finished` (source -> announced count), or None."""
    if len(finished) < s.sources:
        return f"{s.sources - len(finished)} source(s) have not finished"
    total = 0
    for source, count in finished.items():
        have = {seq for (snd, seq) in s.buckets if snd == source}
        missing = sorted(set(range(count)) - have)
        extra = sorted(have - set(range(count)))
        if missing:
            return f"source {source}: missing bucket seq {missing[:8]} of {count}"
        if extra:
            return f"source {source}: got seq {extra[:8]} beyond the {count} announced"
        total += count
    wrong = count_mismatch(s, total)
    if wrong is not None:
        return wrong
    pending = [k for k, b in s.buckets.items() if not b.done]
    if pending:
        return f"{len(pending)} bucket(s) not yet applied by every engine"
    return None


def count_mismatch(s: SyncRecord, total: int) -> str | None:
    """Why `total` announced buckets are not what begin said (None: they are, or it said
    nothing)."""
    if s.expected_buckets is not None and total != s.expected_buckets:
        return f"{total} buckets announced, begin expected {s.expected_buckets}"
    return None


def missing_tensors(s: SyncRecord, engines: dict[str, EngineRecord]) -> tuple[str, list[str]] | None:
    """The first engine (by id) with tensors this sync never sent, and which."""
    for eid in s.participants:
        names = coverage.unsent(engines[eid].spec, s.names)
        if names:
            return eid, names
    return None


def missing_slices(s: SyncRecord, engines: dict[str, EngineRecord]) -> tuple[str, int, list[str]] | None:
    """The first engine that takes slices (by id; one check per layout) with a rank that
    was sent neither its box of some tensor nor the whole of it: (engine, rank, which)."""
    seen: set[str] = set()
    for eid in sorted(s.participants):
        x = engines[eid]
        key = None if x.slices is None else str(x.slices["key"])
        if not x.layout or key is None or key in seen:
            continue
        seen.add(key)
        for r, rank_map in enumerate(layout_of(x.layout)):
            lost = []
            for name, part in rank_map.items():
                sent = s.parts.get(name, set())
                box = None if part == WHOLE else part
                if None not in sent and box not in sent:
                    lost.append(name if box is None else f"{name}{[list(b) for b in box]}")
            if lost:
                return eid, r, lost
    return None


def canary_mismatch(
    probes: tuple[Probe, ...], got: tuple[tuple[int, ...], ...]
) -> tuple[int, int, int | None, int | None] | None:
    """(probe index, first differing position, got, expected) or None if all match."""
    for i, p in enumerate(probes):
        if p.expected is None:
            continue
        out = got[i] if i < len(got) else ()
        exp = p.expected
        for pos in range(max(len(out), len(exp))):
            a = out[pos] if pos < len(out) else None
            b = exp[pos] if pos < len(exp) else None
            if a != b:
                return i, pos, a, b
    return None


def mismatch_text(mismatch: tuple[int, int, int | None, int | None]) -> str:
    idx, pos, got, exp = mismatch
    return f"probe {idx} differs at position {pos} (got {got}, expected {exp})"


def choose_refs(
    msg: Begin, participants: tuple[str, ...], engines: dict[str, EngineRecord], daemon_host: str
) -> tuple[str, tuple[str, ...], bool]:
    """The transport that carries references this sync uses, the engines that read them,
    and whether the others take frames cut from them (`transports.choose_ref`); ("", (),
    False): frames for every engine."""
    return transports.choose_ref(
        msg.transport,
        msg.host,
        daemon_host,
        participants,
        lambda e: engines[e].host,
        lambda e: engines[e].transports,
    )


def wants_group(msg: Begin) -> bool:
    """The trainer asked for a transport that needs a group, or left the choice to us."""
    t = transports.get(msg.transport)
    return msg.transport == transports.AUTO or (t is not None and t.needs_group)


def choose_group(
    msg: Begin,
    participants: tuple[str, ...],
    engines: dict[str, EngineRecord],
    current: GroupRecord | None,
    new_id: str,
    timeout: float,
) -> GroupRecord | None:
    """The group for this sync, or None when it cannot be used: the trainer offered a
    store and every participant can join with a backend all of them speak (NCCL only when
    every member has a GPU). The current group is reused when its session and members are
    the same; otherwise a new one, with a new id, is planned."""
    offer = msg.offer
    if not wants_group(msg) or offer is None or not participants:
        return None
    if any(engines[e].collective_ranks < 1 for e in participants):
        return None
    common = [b for b in offer.backends if all(b in engines[e].collective_backends for e in participants)]
    if not common:
        return None
    backend = "nccl" if "nccl" in common else common[0]
    members, rank = [], 1
    for eid in participants:
        n = engines[eid].collective_ranks
        members.append((eid, rank, n))
        rank += n
    plan = GroupRecord(
        new_id,
        offer.session,
        offer.host,
        offer.port,
        backend,
        tuple(members),
        timeout,
        offer.token,
        offer.store_key,
    )
    if current is not None and dataclasses.replace(current, id=new_id) == plan:
        return current  # everything but the id is the same: the same group
    return plan


def can_stream(msg: Begin, participants: tuple[str, ...], engines: dict[str, EngineRecord]) -> bool:
    """The group's stream (protocol v3): one trainer that frames its broadcasts, and
    every participant able to take them. Otherwise each bucket is announced per engine."""
    offer = msg.offer
    return (
        offer is not None
        and offer.stream
        and msg.sources == 1
        and all(engines[e].collective_stream for e in participants)
    )


def summary(s: SyncRecord, status: str, now: float) -> SyncSummary:
    """The ended sync `s`: the part of `status.last_sync` and of the finish's answer that
    every outcome shares."""
    g = s.group
    return SyncSummary(
        sync_id=s.sync_id,
        version=s.version,
        status=status,
        kind=s.kind,
        buckets=s.bucket_count,
        bytes=s.byte_count,
        seconds=round(now - s.started_at, 6),
        engine_ids=list(s.participants),
        transport=s.shown,
        stream=s.stream,
        group=g.id if g else None,
        world_size=g.world_size if g else None,
        backend=g.backend if g else None,
    )
