"""An engine's progress through one sync, as protocol v2 reports it: cumulative and
coalesced (`loaded {seq: k, also}`: every bucket of a sender up to seq k is applied, and
so are the seqs in `also`, applied ahead of a gap). Torch-free: the engine worker and the
fleet benchmark's simulated engines keep their progress with this one class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from messages.schema import MAX_ALSO, Loaded


@dataclass(slots=True)
class Progress:
    sync_id: str
    applied: set[tuple[int, int]] = field(default_factory=set)  # (sender, seq)
    through: dict[int, int] = field(default_factory=dict)  # sender -> every seq up to it applied
    reported: dict[int, int] = field(default_factory=dict)  # sender -> the last `through` sent
    fresh: dict[int, list[int]] = field(default_factory=dict)  # sender -> applied past a gap, unsent
    count: int = 0  # buckets applied since the last report, and their seconds (metrics)
    seconds: float = 0.0

    def apply(self, sender: int, seq: int, seconds: float = 0.0) -> None:
        """Bucket (sender, seq) is applied (a repeat changes nothing)."""
        if (sender, seq) in self.applied:
            return
        self.applied.add((sender, seq))
        self.count, self.seconds = self.count + 1, self.seconds + seconds
        k = self.through.get(sender, -1)
        if seq == k + 1:
            while (sender, k + 1) in self.applied:
                k += 1
            self.through[sender] = k
        elif seq > k + 1:
            self.fresh.setdefault(sender, []).append(seq)

    def unreported(self) -> bool:
        return any(v for v in self.fresh.values()) or any(
            k > self.reported.get(snd, -1) for snd, k in self.through.items()
        )

    def reports(self) -> list[Loaded]:
        """The `loaded` reports for every sender whose progress moved since the last ones:
        one message in all (the first sender's mark, the others' in `more`), plus one for
        each sender with seqs applied past a gap (at most MAX_ALSO in its `also`; the rest
        go in the next)."""
        out: list[Loaded] = []
        marks: list[tuple[int, int]] = []
        for sender in sorted(set(self.through) | set(self.fresh)):
            k = self.through.get(sender, -1)
            pending = sorted(q for q in self.fresh.pop(sender, ()) if q > k)
            ahead = pending[:MAX_ALSO]
            if pending[MAX_ALSO:]:
                self.fresh[sender] = pending[MAX_ALSO:]
            if ahead:
                self.reported[sender] = k
                out.append(Loaded(sync_id=self.sync_id, seq=k, sender=sender, also=tuple(ahead)))
            elif k > self.reported.get(sender, -1):
                self.reported[sender] = k
                marks.append((sender, k))
        if marks:
            (sender, k), more = marks[0], tuple(marks[1:])
            out.insert(0, Loaded(sync_id=self.sync_id, seq=k, sender=sender, more=more))
        if out:  # the metrics ride on the first
            out[0] = msgspec.structs.replace(out[0], count=self.count, seconds=self.seconds)
            self.count, self.seconds = 0, 0.0
        return out

    def again(self, sender: int, seq: int) -> Loaded:
        """The answer to a resend of an applied bucket: how far its sender is applied."""
        through = self.through.get(sender, -1)
        return Loaded(sync_id=self.sync_id, seq=through, sender=sender, also=(seq,) if seq > through else ())
