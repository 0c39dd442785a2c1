"""A map that holds at most `limit` entries and forgets the least recently used first.

Rules: every cap on a map in weightsync is one of these, its limit a named constant at
its use with one line saying why that size (docs/ARCHITECTURE.md, "Bounded bookkeeping",
lists them). A read (`m[k]`, `get`) or a write counts as a use and makes the entry the
newest; `peek`, `in`, `len` and iteration (oldest first) do not. An entry that `pinned`
says is in use is never evicted: the map then holds more than `limit` until it is
unpinned or removed, so a caller bounds its pins (the groups one sync uses, say).
`on_evict(key, value)` runs for each entry the limit pushes out (to close what it held);
a `del` or `pop` by the caller does not call it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, ItemsView, Iterator, KeysView, MutableMapping, ValuesView
from typing import TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class LRU(MutableMapping[K, V]):
    def __init__(
        self,
        limit: int,
        on_evict: Callable[[K, V], object] | None = None,
        pinned: Callable[[K], bool] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"an LRU holds at least one entry (limit {limit})")
        self.limit = limit
        self._on_evict = on_evict
        self._pinned = pinned
        self._d: OrderedDict[K, V] = OrderedDict()

    def __getitem__(self, key: K) -> V:
        value = self._d[key]
        self._d.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        self.trim()

    def __delitem__(self, key: K) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __repr__(self) -> str:
        return f"LRU(limit={self.limit}, {dict(self._d)!r})"

    def keys(self) -> KeysView[K]:
        return self._d.keys()

    def values(self) -> ValuesView[V]:
        return self._d.values()

    def items(self) -> ItemsView[K, V]:
        return self._d.items()

    @overload
    def peek(self, key: K) -> V | None: ...
    @overload
    def peek(self, key: K, default: D) -> V | D: ...
    def peek(self, key: K, default: object = None) -> object:
        """The entry's value without counting a use."""
        return self._d.get(key, default)

    def touch(self, key: K) -> None:
        """Count a use of `key` (if held) without reading it."""
        if key in self._d:
            self._d.move_to_end(key)

    def newest(self) -> V | None:
        """The value used last, or None when empty."""
        return next(reversed(self._d.values()), None)

    def clear(self) -> None:
        self._d.clear()

    def trim(self) -> None:
        """Evict the least recently used entries not pinned until `limit` holds (called by
        every insert; call it after a pin ends to give back what the pin held over)."""
        if len(self._d) <= self.limit:
            return
        for key in list(self._d):  # oldest first
            if len(self._d) <= self.limit:
                return
            if self._pinned is not None and self._pinned(key):
                continue
            value = self._d.pop(key)
            if self._on_evict is not None:
                self._on_evict(key, value)
