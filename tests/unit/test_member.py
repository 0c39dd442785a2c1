"""An engine's group membership: a group that broke or was closed is never joined again
(its root has left it: a second join would wait out the whole timeout for nobody)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from messages.collective import CollectiveError, Member

REF = {
    "id": "g1.run",
    "host": "127.0.0.1",
    "port": 1,
    "rank": 1,
    "world_size": 2,
    "backend": "gloo",
    "timeout": 30.0,
}


def fake_group(gid: str, broken: bool) -> SimpleNamespace:
    closed = []
    return SimpleNamespace(
        spec=SimpleNamespace(id=gid), broken=broken, close=lambda: closed.append(1), closed=closed
    )


@pytest.mark.parametrize("how", ["broken", "closed"])
def test_a_failed_or_closed_group_is_refused_at_once(how):
    m = Member()
    g = fake_group(REF["id"], broken=how == "broken")
    m.group = g  # as if joined
    if how == "closed":
        m.close()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="not joined again"):
        m.ensure(REF)
    assert time.monotonic() - t0 < 1.0 and g.closed == [1] and m.group is None


def test_a_live_group_is_reused():
    m = Member()
    g = fake_group(REF["id"], broken=False)
    m.group = g
    assert m.ensure(REF) is g and g.closed == []
