"""Which engines take a sync's buckets from the fan-out (messages/fanout.py) and which
get them one send each: decided once per sync, kept per bucket while it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from messages import schema
from messages.fanout import report_interval


@dataclass(slots=True)
class Plan:
    """A sync's fan-out participants, as its `FanoutOpen` named them."""

    inline: frozenset[str]
    shm: frozenset[str]
    broken: bool = False  # a participant dropped out: one send each for the rest of the sync

    def opening(self, sync_id: str, version: int, participants: int) -> schema.FanoutOpen:
        """The sync's first published message: who takes its buckets, and how often the
        `participants` engines report."""
        return schema.FanoutOpen(
            sync_id=sync_id,
            version=version,
            inline=tuple(sorted(self.inline)),
            shm=tuple(sorted(self.shm)),
            report_interval=report_interval(participants),
        )

    @property
    def used(self) -> bool:
        return bool(self.inline or self.shm) and not self.broken

    def route(self, engine_ids: Sequence[str], shm_engines: Collection[str]) -> tuple[bool, bool, list[str]]:
        """One bucket for `engine_ids` (those in `shm_engines` by reference) -> (publish it
        inline?, publish it by reference?, the engines sent it one by one). Publishing
        needs every named participant among the targets, each of its open's kind: an engine
        named but no longer a target (lost, failed) would take the bucket all the same."""
        if not self.used:
            return False, False, list(engine_ids)
        ids = set(engine_ids)
        if not (
            self.inline <= ids and self.shm <= ids and self.shm <= set(shm_engines)
        ) or not self.inline.isdisjoint(shm_engines):
            self.broken = True
            return False, False, list(engine_ids)
        rest = [e for e in engine_ids if e not in self.inline and e not in self.shm]
        return bool(self.inline), bool(self.shm), rest


def plan(engine_ids: Sequence[str], shm_engines: Collection[str], live: Callable[[str], bool]) -> Plan:
    """The participants that take a sync's buckets from the fan-out: those whose
    subscription is in place (`live`) when its first bucket goes out."""
    shm = frozenset(e for e in engine_ids if e in shm_engines and live(e))
    inline = frozenset(e for e in engine_ids if e not in shm_engines and live(e))
    return Plan(inline, shm)
