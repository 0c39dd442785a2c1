"""The same-host reference transport: a trainer's slots are segments of shared memory
(`messages.segments`) that its engines and the daemon map by name; `messages.transports`
registers it as `segments.VIA`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from messages import schema
from messages.errors import ErrorCode, make_error
from messages.segments import Segment, ShmFull, available, frombuffer, sweep_stale

if TYPE_CHECKING:
    import torch


# -- the trainer's side: its slots ----------------------------------------------------
class ShmRing:
    """Up to `slots` shared-memory slots; bucket `seq` is packed straight into slot
    seq % len(segments). A tmpfs with room for fewer (but at least `least`) slots gets a
    smaller ring, and the window stays within it; with room for fewer, ShmFull."""

    def __init__(self, slots: int, slot_bytes: int, least: int = 2) -> None:
        self.slot_bytes = slot_bytes
        self.wanted = slots  # what was asked for; `slots` may be fewer (a small tmpfs)
        self.segments: list[Segment] = []
        try:
            for _ in range(slots):
                self.segments.append(Segment(max(slot_bytes, 4096), kind="trainer"))
        except ShmFull:
            if len(self.segments) < min(least, slots):
                self.close()
                raise
        except BaseException:
            self.close()
            raise

    @property
    def slots(self) -> int:
        return len(self.segments)

    def slot(self, seq: int, nbytes: int) -> torch.Tensor:
        seg = self.segments[seq % len(self.segments)]
        try:
            seg.resize(nbytes)  # a tensor larger than the bucket size gets its own bucket
        except ShmFull as exc:
            raise make_error(
                ErrorCode.TOO_LARGE,
                f"{exc}; a bucket of {nbytes} bytes needs that "
                f"much free shared memory per slot (window {len(self.segments)}), "
                f"or push with transport=inline",
            ) from None
        out: torch.Tensor = frombuffer(seg.view(0, nbytes))
        return out

    def ref(self, seq: int, nbytes: int) -> schema.Ref:
        return schema.Ref(self.segments[seq % len(self.segments)].name, 0, nbytes)

    def close(self) -> None:
        for seg in self.segments:
            seg.close()


class ShmRings:
    """The client's shared-memory ring, reserved once and kept for its later pushes
    (reserving and faulting slots in per push cost more than packing a small model);
    replaced when a push wants bigger or more slots than it asked for (not when the tmpfs
    had room for fewer: asking again gets no more)."""

    def __init__(self) -> None:
        self.ring: ShmRing | None = None

    def get(self, window: int, bucket_bytes: int) -> ShmRing | None:
        """Slots for this push, or None: push inline (no shared memory, or no room)."""
        ring = self.ring
        if ring is not None and ring.slot_bytes >= bucket_bytes and ring.wanted >= window:
            return ring
        self.drop()
        if not available():
            return None
        sweep_stale()  # segments of trainers that crashed earlier on this host
        try:
            self.ring = ShmRing(window, bucket_bytes)
        except ShmFull as exc:
            from messages.liblog import get_logger  # noqa: PLC0415 (no logging library at import)

            get_logger("trainer").warning(
                "shm_full_using_inline", reason=str(exc), window=window, bucket_bytes=bucket_bytes
            )
            return None
        return self.ring

    def drop(self) -> None:
        """Unlink the slots (after a failed push an engine may still read one)."""
        if self.ring is not None:
            self.ring.close()
        self.ring = None
