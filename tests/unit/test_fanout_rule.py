"""The fan-out's queue rule (messages.fanout): over any number of sources and any bucket
size, a participant's queue holds the sync's open and every source's window twice over
(libzmq's writer learns what its reader took only every half queue), and a connection
that never reads holds at most the budget in bytes. The core caps a sync's bucket size by
the same rule and refuses a larger frame."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.errors import ErrorCode, WeightSyncError
from messages.fanout import max_bucket, queue_len, sync_queue
from messages.replies import BeginReply, decode
from messages.schema import Begin, Bucket, Register, TensorMeta
from orchestrator.core import Core, Limits
from orchestrator.core import events as ev

MiB = 1 << 20


@given(
    sources=st.integers(1, 64),
    bucket=st.integers(4 * MiB, 64 * MiB),
    budget=st.sampled_from([64 * MiB, 192 * MiB, 512 * MiB, 2048 * MiB]),
    max_pending=st.integers(1, 256),
)
@settings(max_examples=500, deadline=None)
def test_the_queue_holds_every_sources_window_and_stays_within_the_budget(
    sources, bucket, budget, max_pending
):
    cut = min(bucket, max_bucket(budget, sources))
    per_source = max(1, max_pending // sources)
    cap, queue = sync_queue(budget, cut, sources, per_source)
    assert 1 <= cap <= per_source
    assert queue >= 2 * (cap * sources + 1)  # a participant: open + every window, twice over
    assert (queue + 1) * cut <= budget  # a non-reader + the frame in flight, in bytes (split)


def test_eight_sources_at_16_mib_are_cut_to_what_the_default_budget_holds():
    cut = min(16 * MiB, max_bucket(192 * MiB, 8))
    assert cut == 192 * MiB // (queue_len(8) + 1) and cut < 11 * MiB


def _core(fanout_bytes=192 * MiB):
    o = Core(Limits(min_engines=1, fanout_bytes=fanout_bytes))
    o.handle(ev.EngineRegistered(Register(engine_id="e0", backend="torch")), 0.0)
    return o


@pytest.mark.parametrize(
    "asked,sources,cut", [(64 * MiB, 1, 192 * MiB // 5), (16 * MiB, 1, 16 * MiB), (None, 8, 192 * MiB // 19)]
)
def test_the_begin_reply_says_the_bucket_size_the_daemon_takes(asked, sources, cut):
    o = _core()
    res = o.handle(ev.BeginSync(Begin(sync_id="s1", version=1, bucket_bytes=asked, sources=sources)), 1.0)
    assert decode(res.reply, BeginReply).bucket_bytes == cut


def test_a_frame_larger_than_the_syncs_bucket_size_is_refused_and_changes_nothing():
    o = _core()
    o.handle(ev.BeginSync(Begin(sync_id="s1", version=1, bucket_bytes=1 * MiB)), 1.0)
    meta = (TensorMeta("w", "uint8", (MiB + 1,), 0, MiB + 1),)
    with pytest.raises(WeightSyncError) as err:
        o.handle(ev.BucketIn(Bucket(sync_id="s1", seq=0, tensors=meta, checksum=0), MiB + 1), 1.0)
    assert err.value.code == ErrorCode.TOO_LARGE and "at most 1048576" in err.value.message
    assert o.sync is not None and not o.sync.buckets and o.state.value == "LOADING_BUCKETS"
