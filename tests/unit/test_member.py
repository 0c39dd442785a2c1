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
    m.groups[("127.0.0.1", 1)] = g  # as if joined
    if how == "closed":
        m.close()
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="not joined again"):
        m.ensure(REF)
    assert time.monotonic() - t0 < 1.0 and g.closed == [1] and m.group is None


def test_a_live_group_is_reused():
    m = Member()
    g = fake_group(REF["id"], broken=False)
    m.groups[("127.0.0.1", 1)] = g
    assert m.ensure(REF) is g and g.closed == []


def test_each_store_keeps_its_own_group_and_a_new_group_of_a_store_replaces_its_old_one():
    """A sharded push's sources each broadcast from a group of their own: the engine keeps
    one open per source's store; a new group from the same store closes that store's old one."""
    m = Member()
    a, b = fake_group("ga", broken=False), fake_group("gb", broken=False)
    m.groups[("127.0.0.1", 1)], m.groups[("127.0.0.1", 2)] = a, b
    assert m.ensure({**REF, "id": "ga", "port": 1}) is a and m.ensure({**REF, "id": "gb", "port": 2}) is b
    assert a.closed == b.closed == [] and m.group is b
    m._dead.add("gb2")  # (so that no real join is tried below)
    with pytest.raises(CollectiveError, match="not joined again"):
        m.ensure({**REF, "id": "gb2", "port": 2})  # store 2's next group
    assert b.closed == [1] and a.closed == [] and list(m.groups) == [("127.0.0.1", 1)]
    m.close()
    assert a.closed == [1] and not m.groups
