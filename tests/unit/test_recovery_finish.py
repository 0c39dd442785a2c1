"""The daemon's rollback on a real spool, with the dispatcher's answers scripted: a
refused finish that leaves the rollback running aborts it at the next pump, instead of
holding the fleet until --sync-timeout."""

from __future__ import annotations

import asyncio
from typing import Any

from messages import schema
from messages.errors import ErrorCode, make_error
from orchestrator.core import commands as cmd
from orchestrator.core import events as ev
from orchestrator.daemon.recovery import Recovery
from orchestrator.daemon.spool import Spool

TENSORS = [{"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}]


class Answers:
    """Answers each of the daemon's own requests at once: buckets ok, the finish refused."""

    def __init__(self, finish_error: Any) -> None:
        self.sent: list[schema.Bucket | schema.Finish] = []
        self.finish_error = finish_error

    async def local_request(self, msg: Any, payload: list[Any], on_reply: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, schema.Finish):
            on_reply(None, self.finish_error)
        else:
            on_reply({"seq": msg.seq}, None)


class NoEngines:
    def send_engine(self, engine_id: str, frames: Any) -> bool:
        raise AssertionError("a rollback goes through the dispatcher, not to an engine directly")


def _rollback(tmp_path, finish_error):
    spool = Spool(tmp_path)
    spool.begin("s1", 3)
    spool.add("s1", 0, 0, TENSORS, 1, b"x" * 8)
    spool.add("s1", 0, 1, TENSORS, 2, b"y" * 8)
    spool.commit("s1", 3, "d3", ())
    fed: list[ev.Event] = []

    async def feed(e: ev.Event) -> None:
        fed.append(e)

    answers = Answers(finish_error)
    r = Recovery(spool, answers, NoEngines(), feed)
    r.start_rollback(cmd.StartRollback("rollback-1", 3, "d3"))
    return r, answers, fed


def test_a_refused_finish_aborts_the_rollback_at_the_next_pump(tmp_path):
    refusal = make_error(ErrorCode.INCOMPLETE_SYNC, "1 of 2 buckets")
    r, answers, fed = _rollback(tmp_path, refusal)

    async def run() -> None:
        await r.pump()  # both spooled buckets, acked at once; then the finish, refused
        assert [type(m).__name__ for m in answers.sent] == ["Bucket", "Bucket", "Finish"]
        assert fed == []
        await r.pump()

    asyncio.run(run())
    assert len(fed) == 1 and isinstance(fed[0], ev.AbortSync), fed
    abort = fed[0]
    assert (abort.sync_id, abort.by) == ("rollback-1", "daemon")
    assert "INCOMPLETE_SYNC: 1 of 2 buckets" in abort.reason
    assert len(answers.sent) == 3  # the finish is not sent again


def test_an_accepted_finish_is_sent_once_and_nothing_is_aborted(tmp_path):
    r, answers, fed = _rollback(tmp_path, None)

    async def run() -> None:
        for _ in range(3):
            await r.pump()

    asyncio.run(run())
    assert [type(m).__name__ for m in answers.sent] == ["Bucket", "Bucket", "Finish"]
    assert fed == []
