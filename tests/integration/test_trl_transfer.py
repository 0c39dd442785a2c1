"""`orchestrator.trainer.trl.WeightSyncTransfer`, driven the way TRL's AsyncGRPO trainer
drives its weight transfer (init once; per sync pause, send_weights(iterator), resume;
destroy), against a real daemon and torch engines. TRL itself is not installed here:
these calls are the protocol's, not TRL's trainer (docs/INTEGRATIONS.md)."""

from __future__ import annotations

import signal
import time

import pytest

from examples.tiny import perturbed
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.trainer.trl import WeightSyncTransfer

from .helpers import running_daemon

pytestmark = pytest.mark.slow


def _sync(wt: WeightSyncTransfer, items) -> None:
    """TRL's _sync_weight on the main process: pause, send the iterator, resume."""
    wt.pause()
    wt.send_weights(iter(items))
    wt.resume()


def test_each_send_weights_commits_the_next_version_on_every_engine(tmp_path, tiny_model_dir, tiny_state):
    with running_daemon(tmp_path, tiny_model_dir, engines=2) as c:
        wt = WeightSyncTransfer(c.addr, timeout=30.0)
        wt.init_weight_transfer()
        assert wt.version is None  # a fresh fleet serves nothing
        try:
            for v in (1, 2, 3):
                w = list(perturbed(tiny_state, v))
                _sync(wt, w)
                assert wt.version == v and wt.last is not None and wt.last.state == "READY"
                st = c.status()
                assert st["state"] == "READY" and st["version"] == v
                assert {e["digest"] for e in st["engines"]} == {digest(w)}
                assert all(e["version"] == v for e in st["engines"])
        finally:
            wt.destroy()
        # a trainer restarted against the running fleet continues after what it serves
        again = WeightSyncTransfer(c.addr, timeout=30.0)
        again.init_weight_transfer()
        try:
            assert again.version == 3
            _sync(again, list(perturbed(tiny_state, 4)))
            assert again.version == 4 and c.status()["version"] == 4
        finally:
            again.destroy()


def test_an_engine_killed_mid_send_raises_in_time_and_the_next_send_commits_on_the_survivor(
    tmp_path, tiny_model_dir, tiny_state
):
    """SIGKILL one of two engines while send_weights streams: it raises (never returns as
    if the version were served) within the engine deadline plus 10 s, and the next
    send_weights commits on the survivor."""
    args = ["--engine-timeout", "5", "--log-level", "info"]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, min_engines=1, daemon_args=args) as c:
        wt = WeightSyncTransfer(c.addr, timeout=30.0, bucket_bytes=64 * 1024, window=1)
        wt.init_weight_transfer()
        try:
            _sync(wt, list(perturbed(tiny_state, 1)))
            victim = next(p for p in c.procs if p.name == "engine-1")

            def killing():
                for i, item in enumerate(perturbed(tiny_state, 2)):
                    if i == 4:
                        victim.popen.send_signal(signal.SIGKILL)
                        victim.popen.wait(30)
                    yield item

            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as ei:
                _sync(wt, killing())
            assert time.monotonic() - t0 < 5 + 10
            assert ei.value.code is ErrorCode.ENGINE_FAILED and "engine-1" in ei.value.message
            assert wt.version == 1  # nothing new committed
            w = list(perturbed(tiny_state, 3))
            _sync(wt, w)
            st = c.status()
            assert wt.version == st["version"] and st["state"] == "READY"
            engines = {e["engine_id"]: e for e in st["engines"]}
            assert engines["engine-0"]["digest"] == digest(w) and engines["engine-1"]["state"] == "LOST"
        finally:
            wt.destroy()
