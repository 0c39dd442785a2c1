"""The one bounded map (messages.bounded.LRU): a use keeps an entry, the least recently
used goes first, a pinned entry never goes, and eviction tells its owner."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages.bounded import LRU


def test_the_least_recently_used_goes_first_and_a_read_counts_as_a_use():
    m: LRU[str, int] = LRU(2)
    m["a"], m["b"] = 1, 2
    assert m["a"] == 1  # a use: "b" is now the oldest
    m["c"] = 3
    assert list(m) == ["a", "c"] and "b" not in m


def test_peek_in_and_iteration_are_not_uses():
    m: LRU[str, int] = LRU(2)
    m["a"], m["b"] = 1, 2
    assert m.peek("a") == 1 and "a" in m and list(m.items()) == [("a", 1), ("b", 2)]
    assert m.peek("zz") is None and m.peek("zz", 7) == 7
    m["c"] = 3
    assert list(m) == ["b", "c"]


def test_get_setdefault_and_rewrite_are_uses():
    m: LRU[str, int] = LRU(3)
    m["a"], m["b"], m["c"] = 1, 2, 3
    assert m.get("a") == 1 and m.setdefault("b", 9) == 2
    m["c"] = 30  # a write is a use too
    m["d"] = 4
    assert list(m) == ["b", "c", "d"] and m.newest() == 4


def test_eviction_calls_on_evict_but_a_callers_delete_does_not():
    gone: list[tuple[str, int]] = []
    m: LRU[str, int] = LRU(1, on_evict=lambda k, v: gone.append((k, v)))
    m["a"] = 1
    m["b"] = 2
    assert gone == [("a", 1)]
    del m["b"]
    m["c"] = 3
    assert m.pop("c") == 3 and gone == [("a", 1)] and len(m) == 0 and m.newest() is None


def test_a_pinned_entry_is_never_evicted_and_trim_gives_back_the_excess_once_unpinned():
    busy = {"a", "b"}
    gone: list[str] = []
    m: LRU[str, int] = LRU(2, on_evict=lambda k, v: gone.append(k), pinned=busy.__contains__)
    m["a"], m["b"] = 1, 2
    m["c"] = 3  # the oldest unpinned is the newcomer itself
    assert gone == ["c"] and list(m) == ["a", "b"]
    busy.add("d")
    m["d"] = 4  # every entry pinned: the map holds more than its limit
    assert list(m) == ["a", "b", "d"] and gone == ["c"]
    busy.clear()
    m.trim()
    assert list(m) == ["b", "d"] and gone == ["c", "a"]


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        LRU(0)


@given(st.integers(1, 8), st.lists(st.tuples(st.booleans(), st.integers(0, 15)), max_size=200))
def test_it_never_holds_more_than_its_limit_and_keeps_the_newest(limit, ops):
    """Against a plain model: the map holds exactly the `limit` keys used last."""
    m: LRU[int, int] = LRU(limit)
    order: list[int] = []  # keys, least recently used first
    for write, k in ops:
        if write:
            m[k] = k
        elif k in m:
            assert m[k] == k
        else:
            continue
        if k in order:
            order.remove(k)
        order.append(k)
        order = order[-limit:]
        assert len(m) <= limit and list(m) == order
