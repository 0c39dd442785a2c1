"""Which engines take a sync's buckets from the fan-out (messages/fanout.py) and which
get them one send each: decided once per sync, kept per bucket while it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from messages import schema
from messages.fanout import report_interval


@dataclass(slots=True)
class Audience:
    """A sync's fan-out participants, as its `FanoutOpen` named them."""

    frames: frozenset[str]  # take the bucket's frame
    refs: frozenset[str]  # read the bucket by its reference
    broken: bool = False  # a participant dropped out: one send each for the rest of the sync

    def opening(self, sync_id: str, version: int, participants: int) -> schema.FanoutOpen:
        """The sync's first published message: who takes its buckets, and how often the
        `participants` engines report."""
        return schema.FanoutOpen(
            sync_id=sync_id,
            version=version,
            frames=tuple(sorted(self.frames)),
            refs=tuple(sorted(self.refs)),
            report_interval=report_interval(participants),
        )

    @property
    def used(self) -> bool:
        return bool(self.frames or self.refs) and not self.broken

    def route(self, engine_ids: Sequence[str], ref_engines: Collection[str]) -> tuple[bool, bool, list[str]]:
        """One bucket for `engine_ids` (those in `ref_engines` by reference) -> (publish its
        frame?, publish it by reference?, the engines sent it one by one). Publishing
        needs every named participant among the targets, each of its open's kind: an engine
        named but no longer a target (lost, failed) would take the bucket all the same."""
        if not self.used:
            return False, False, list(engine_ids)
        ids = set(engine_ids)
        if not (
            self.frames <= ids and self.refs <= ids and self.refs <= set(ref_engines)
        ) or not self.frames.isdisjoint(ref_engines):
            self.broken = True
            return False, False, list(engine_ids)
        rest = [e for e in engine_ids if e not in self.frames and e not in self.refs]
        return bool(self.frames), bool(self.refs), rest


def audience(
    engine_ids: Sequence[str], ref_engines: Collection[str], live: Callable[[str], bool]
) -> Audience:
    """The participants that take a sync's buckets from the fan-out: those whose
    subscription is in place (`live`) when its first bucket goes out."""
    refs = frozenset(e for e in engine_ids if e in ref_engines and live(e))
    frames = frozenset(e for e in engine_ids if e not in ref_engines and live(e))
    return Audience(frames, refs)
