"""An engine's group membership: a group that broke or was closed is never joined again
(its root has left it: a second join would wait out the whole timeout for nobody)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from messages.distgroup import GroupError, Member

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
    with pytest.raises(GroupError, match="not joined again"):
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
    with pytest.raises(GroupError, match="not joined again"):
        m.ensure({**REF, "id": "gb2", "port": 2})  # store 2's next group
    assert b.closed == [1] and a.closed == [] and list(m.groups) == [("127.0.0.1", 1)]
    m.close()
    assert a.closed == [1] and not m.groups


@pytest.fixture
def three_groups(monkeypatch):
    """Members that keep 3 groups open, joining fakes (no real rendezvous)."""
    import messages.distgroup as distgroup

    monkeypatch.setattr(distgroup, "MAX_GROUPS", 3)
    monkeypatch.setattr(distgroup, "Group", lambda spec, give_up=None: fake_group(spec.id, broken=False))
    return [{**REF, "id": f"g{p}", "port": p} for p in range(6)]


def test_groups_are_evicted_by_last_use_not_by_join_order(three_groups):
    """Past MAX_GROUPS the group used least recently closes, not the one joined first."""
    ref, m = three_groups, Member()
    g0, g1, g2 = (m.ensure(ref[p]) for p in range(3))
    assert m.ensure(ref[0]) is g0  # store 0 used again (it joined first)
    g3 = m.ensure(ref[3])  # one too many: the least recently used (store 1) goes
    assert g1.closed == [1] and g0.closed == g2.closed == [] and m.group is g3
    assert list(m.groups) == [("127.0.0.1", 2), ("127.0.0.1", 0), ("127.0.0.1", 3)]


def test_a_group_the_running_sync_used_is_never_closed_under_it(three_groups):
    """A group the running sync used stays open whatever its age; once that sync is over,
    the excess it held goes, least recently used first."""
    ref, m = three_groups, Member()
    g0, g1, g2 = (m.ensure(ref[p], sync="s1") for p in range(3))
    m.ensure(ref[0], sync="s2")
    g3 = m.ensure(ref[3], sync="s2")  # store 1 is the oldest and s2 never used it: it goes
    m.ensure(ref[4], sync="s2")  # so does store 2
    assert g1.closed == g2.closed == [1] and g0.closed == g3.closed == []
    m.ensure(ref[5], sync="s2")  # all three open were used by s2: none closes under it
    assert len(m.groups) == 4 and g0.closed == g3.closed == []
    m.ensure(ref[5], sync="s3")  # s2 ended: the group it held over the limit goes
    assert len(m.groups) == 3 and g0.closed == [1] and g3.closed == []


def test_a_finished_sync_keeps_only_its_own_groups_open(three_groups):
    """Open groups <= live sources: once a sync finished (every source sent everything), the
    groups it did not use (a source that went away, an earlier layout's stores) close, and
    its own stay open for the next push; a sync that is not the one received last closes
    nothing (a late answer must not close the running sync's groups)."""
    ref, m = three_groups, Member()
    g0, g1, g2 = (m.ensure(ref[p], sync="s1") for p in range(3))  # three sources
    m.ensure(ref[0], sync="s2")  # the next version has two: stores 0 and 2
    m.ensure(ref[2], sync="s2")
    assert m.keep_used("s1") == 0 and len(m.groups) == 3  # not the sync received last
    assert m.keep_used("s2") == 1
    assert g1.closed == [1] and g0.closed == g2.closed == []
    assert set(m.groups) == {("127.0.0.1", 0), ("127.0.0.1", 2)}
    with pytest.raises(GroupError, match="not joined again"):
        m.ensure(ref[1], sync="s3")  # a closed group is never joined again
