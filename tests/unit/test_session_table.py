"""The engine's table decides every case: each (phase, input) pair is a row or the typed
refusal, a refusal or an ignored input changes nothing; docs/ARCHITECTURE.md's engine table
is rendered from the table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from engines.session import FROM_DAEMON, Go, Ignore, Input, Phase, Refusal, Send, Session, decide, render
from messages import schema
from tests.unit.session_inputs import GROUP, failed, finalized, load


def in_phase(phase: Phase) -> Session:
    """An engine whose sync "s1" is in `phase`, reached through its inputs only; when a
    record exists, bucket 0 is applied and bucket 1 queued."""
    s = Session()
    if phase is Phase.NEW:
        return s
    s.feed(
        schema.OpenStream(sync_id="s1", version=1, group=GROUP) if phase is Phase.STREAMING else load("s1", 0)
    )
    if phase is Phase.STREAMING:
        s.feed(load("s1", 0))
    s.feed(load("s1", 1))
    s.result(schema.Loaded(sync_id="s1", seq=0))
    if phase in (Phase.FINALIZING, Phase.FINALIZED, Phase.SPENT, Phase.PAST):
        s.feed(schema.Finalize(sync_id="s1", version=1))
    if phase is Phase.FINALIZED:
        s.result(finalized("s1"))
    if phase in (Phase.FAILED, Phase.SPENT):
        s.result(failed("s1"))
    if phase is Phase.ABORTED:
        s.feed(schema.Abort(sync_id="s1"))
    if phase is Phase.PAST:
        s.feed(load("s2", 0, version=2))
    assert s.phase_of("s1") is phase
    return s


MESSAGES: dict[Input, schema.Message] = {
    Input.LOAD: load("s1", 7),
    Input.RESENT: load("s1", 0),
    Input.QUEUED: load("s1", 1),
    Input.STREAM: schema.OpenStream(sync_id="s1", version=1, group=GROUP),
    Input.FINALIZE: schema.Finalize(sync_id="s1", version=1),
    Input.COMMIT: schema.Commit(sync_id="s1", version=1),
    Input.SERVED: schema.Served(sync_id="s1", version=1, digest="d"),
    Input.ABORT: schema.Abort(sync_id="s1"),
    Input.LOADED: schema.Loaded(sync_id="s1", seq=7),
    Input.PREPARED: schema.Prepared(sync_id="s1", buckets=1, nbytes=1, chain=1, digest="d"),
    Input.FINALIZED: finalized("s1"),
    Input.COMMITTED: schema.Committed(sync_id="s1", version=1, label="1"),
    Input.FAILED: failed("s1"),
}


def snapshot(s: Session) -> tuple[Any, ...]:
    c = s.current
    record = None if c is None else (c.sync_id, c.phase, frozenset(c.queued), frozenset(c.progress.applied))
    return (record, frozenset(s.finalized), s.version, s.digest)


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("inp", list(Input))
def test_every_phase_and_input_is_a_row_or_the_typed_refusal_and_a_refusal_changes_nothing(phase, inp):
    s = in_phase(phase)
    msg = MESSAGES[inp]
    row = decide(phase, inp)
    assert isinstance(row, Go | Ignore | Refusal)
    if s.input_of(msg) is not inp:  # a resent or queued bucket needs a record of its sync
        assert phase in (Phase.NEW, Phase.PAST) and inp in (Input.RESENT, Input.QUEUED)
        assert isinstance(row, Refusal)
        return
    before, dups = snapshot(s), s.duplicates_refused
    out = s.feed(msg) if type(msg) in FROM_DAEMON else s.result(msg)
    if isinstance(row, Refusal):
        (refusal,) = [a.msg for a in out if isinstance(a, Send)]
        assert len(out) == 1 and isinstance(refusal, schema.Failed) and refusal.sync_id == "s1"
        assert refusal.code == "INVALID_STATE" and refusal.duplicate is (
            inp is Input.FINALIZE and phase in (Phase.FINALIZING, Phase.FINALIZED, Phase.SPENT, Phase.PAST)
        )
        assert snapshot(s) == before and s.duplicates_refused == dups + refusal.duplicate
    elif isinstance(row, Ignore):
        assert out == [] and snapshot(s) == before
    else:
        assert s.phase_of("s1") is (row.to if row.to is not None else phase)


def test_no_bucket_stream_or_finalize_is_taken_after_finalize_or_abort():
    """The rows that guard the weights: after finalize nothing more reaches them."""
    for phase in (Phase.FINALIZING, Phase.FINALIZED, Phase.PAST):
        for inp in (Input.LOAD, Input.FINALIZE):
            assert isinstance(decide(phase, inp), Refusal), (phase, inp)
    assert isinstance(decide(Phase.PAST, Input.STREAM), Refusal)
    assert isinstance(decide(Phase.ABORTED, Input.FINALIZE), Refusal)
    assert isinstance(decide(Phase.SPENT, Input.FINALIZE), Refusal)


def test_the_architecture_docs_engine_table_is_the_code_s():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    found = re.search(
        r"<!-- engine table: generated .*? -->\n\n(.*?)\n\n<!-- end of engine table -->", doc, re.S
    )
    assert found is not None, "docs/ARCHITECTURE.md has no engine table"
    assert found.group(1) == render()
