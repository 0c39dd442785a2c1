"""The engine side's own state machine (`engines.session.Session`), as pure logic: what each
message from the daemon and each report of the applier makes the engine do."""

from __future__ import annotations

import pytest

from engines.session import Begin, Go, Input, Phase, Refusal, Send, Session, Stop, Submit, decide
from messages import schema


def load(sync_id: str = "s1", seq: int = 0, version: int = 1) -> schema.Load:
    return schema.Load(sync_id=sync_id, version=version, seq=seq, tensors=(), checksum=0)


def finalize(sync_id: str = "s1", version: int = 1) -> schema.Finalize:
    return schema.Finalize(sync_id=sync_id, version=version)


def jobs(actions) -> list:
    return [a.job for a in actions if isinstance(a, Submit)]


def sent(actions) -> list:
    return [a.msg for a in actions if isinstance(a, Send)]


def test_the_first_message_begins_the_sync_and_a_resend_is_acknowledged_not_applied():
    s = Session(3, "d3")
    first = s.feed(load(seq=0), payload=b"x")
    assert jobs(first) == [Begin("s1", 1), load(seq=0)] and s.phase is Phase.LOADING
    assert (s.version, s.digest) == (None, None)  # the weights are about to change
    assert jobs(s.feed(load(seq=0))) == []  # queued already: not queued twice
    s.result(schema.Loaded(sync_id="s1", seq=0))
    again = s.feed(load(seq=0))
    assert jobs(again) == [] and [type(m) for m in sent(again)] == [schema.Loaded]


def test_finalize_runs_once_per_sync_even_after_it_was_superseded():
    s = Session()
    s.feed(load())
    assert jobs(s.feed(finalize())) == [finalize()] and s.phase is Phase.FINALIZING
    out = s.result(schema.Finalized(sync_id="s1", version=1, digest="d1", finalize_count=1))
    assert s.phase is Phase.FINALIZED and (s.version, s.digest) == (1, "d1") and sent(out)
    s.feed(load("s2", version=2))  # a new sync: s1 is no longer tracked
    for _ in range(2):
        dup = s.feed(finalize("s1"))
        assert jobs(dup) == [] and [m.duplicate for m in sent(dup)] == [True]
    assert s.duplicates_refused == 2 and s.current is not None and s.current.sync_id == "s2"


def test_a_new_sync_supersedes_the_running_one_and_stops_its_stream():
    s = Session()
    group = schema.GroupRef(
        id="g", host="127.0.0.1", port=2000, rank=1, world_size=2, backend="gloo", timeout=5.0
    )
    s.feed(schema.OpenStream(sync_id="s1", version=1, group=group))
    assert s.phase is Phase.STREAMING
    out = s.feed(load("s2", version=2))
    assert Stop("s1") in out and jobs(out)[0] == Begin("s2", 2) and s.phase is Phase.LOADING


def test_after_a_failure_nothing_more_is_applied_or_reported():
    s = Session(1, "d1")
    s.feed(load(seq=0))
    s.result(schema.Failed(sync_id="s1", code="ENGINE_FAILED", message="boom", seq=0))
    assert s.phase is Phase.FAILED and s.reporting() is None and (s.version, s.digest) == (None, None)
    assert jobs(s.feed(load(seq=1))) == []


def test_an_abort_stops_the_stream_only_of_the_sync_it_names():
    s = Session()
    unknown = s.feed(schema.Abort(sync_id="other"))
    assert unknown == [Stop("other", stream=False)]  # only its published buckets are dropped
    s.feed(load())
    out = s.feed(schema.Abort(sync_id="s1"))
    assert Stop("s1") in out and jobs(out) == [schema.Abort(sync_id="s1")] and s.phase is Phase.ABORTED
    assert jobs(s.feed(load(seq=5))) == []  # a late bucket of an aborted sync is dropped


@pytest.mark.parametrize("phase", list(Phase))
def test_the_table_says_every_phase_can_be_aborted_and_nothing_leaves_aborted(phase):
    row = decide(phase, Input.ABORT)
    assert isinstance(row, Go)
    if phase in (Phase.LOADING, Phase.STREAMING, Phase.FAILED, Phase.ABORTED):
        assert row.to is Phase.ABORTED
    leaving = [
        i
        for i in Input
        if isinstance(r := decide(Phase.ABORTED, i), Go) and r.to not in (None, Phase.ABORTED)
    ]
    assert leaving == []


@pytest.mark.parametrize("finalized", [False, True])
def test_a_new_bucket_after_finalize_is_refused_by_its_table_row_and_never_applied(finalized):
    s = Session()
    s.feed(load(seq=0))
    s.result(schema.Loaded(sync_id="s1", seq=0))
    s.feed(finalize())
    if finalized:
        s.result(schema.Finalized(sync_id="s1", version=1, digest="d1", finalize_count=1))
    phase = s.phase
    out = s.feed(load(seq=1), payload=b"x")
    assert jobs(out) == []  # the applier never sees it: nothing is copied into the weights
    (refusal,) = sent(out)
    assert (refusal.code, refusal.seq, refusal.duplicate) == ("INVALID_STATE", 1, False)
    assert "after finalize" in refusal.message
    assert s.phase is phase and (s.version, s.digest) == ((1, "d1") if finalized else (None, None))
    assert [type(m) for m in sent(s.feed(load(seq=0)))] == [schema.Loaded]  # a resend: acked again
    assert isinstance(decide(phase, Input.LOAD), Refusal)
