"""An engine's progress through one sync, as protocol v2 reports it: cumulative and
coalesced (`loaded {seq: k, also}`: every bucket of a source up to seq k is applied, and
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
    applied: set[tuple[int, int]] = field(default_factory=set)  # (source, seq)
    through: dict[int, int] = field(default_factory=dict)  # source -> every seq up to it applied
    reported: dict[int, int] = field(default_factory=dict)  # source -> the last `through` sent
    fresh: dict[int, list[int]] = field(default_factory=dict)  # source -> applied past a gap, unsent
    count: int = 0  # buckets applied since the last report, and their seconds (metrics)
    seconds: float = 0.0

    def apply(self, source: int, seq: int, seconds: float = 0.0) -> None:
        """Bucket (source, seq) is applied (a repeat changes nothing)."""
        if (source, seq) in self.applied:
            return
        self.applied.add((source, seq))
        self.count, self.seconds = self.count + 1, self.seconds + seconds
        k = self.through.get(source, -1)
        if seq == k + 1:
            while (source, k + 1) in self.applied:
                k += 1
            self.through[source] = k
        elif seq > k + 1:
            self.fresh.setdefault(source, []).append(seq)

    def unreported(self) -> bool:
        return any(v for v in self.fresh.values()) or any(
            k > self.reported.get(snd, -1) for snd, k in self.through.items()
        )

    def reports(self) -> list[Loaded]:
        """The `loaded` reports for every source whose progress moved since the last ones:
        one message in all (the first source's mark, the others' in `more`), plus one for
        each source with seqs applied past a gap (at most MAX_ALSO in its `also`; the rest
        go in the next)."""
        out: list[Loaded] = []
        marks: list[tuple[int, int]] = []
        for source in sorted(set(self.through) | set(self.fresh)):
            k = self.through.get(source, -1)
            pending = sorted(q for q in self.fresh.pop(source, ()) if q > k)
            ahead = pending[:MAX_ALSO]
            if pending[MAX_ALSO:]:
                self.fresh[source] = pending[MAX_ALSO:]
            if ahead:
                self.reported[source] = k
                out.append(Loaded(sync_id=self.sync_id, seq=k, source=source, also=tuple(ahead)))
            elif k > self.reported.get(source, -1):
                self.reported[source] = k
                marks.append((source, k))
        if marks:
            (source, k), more = marks[0], tuple(marks[1:])
            out.insert(0, Loaded(sync_id=self.sync_id, seq=k, source=source, more=more))
        if out:  # the metrics ride on the first
            out[0] = msgspec.structs.replace(out[0], count=self.count, seconds=self.seconds)
            self.count, self.seconds = 0, 0.0
        return out

    def again(self, source: int, seq: int) -> Loaded:
        """The answer to a resend of an applied bucket: how far its source is applied."""
        through = self.through.get(source, -1)
        return Loaded(sync_id=self.sync_id, seq=through, source=source, also=(seq,) if seq > through else ())
