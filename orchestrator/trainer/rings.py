"""The trainer's bucket buffers for frames: `window` reusable slots in process memory.
Bucket `seq` is packed into slot `seq % window`; a slot is reused only after its bucket was
acknowledged by every engine (the client waits for that). A transport that carries
references brings its own slots (messages.transports: `Rings`).
"""

from __future__ import annotations

import torch


class FrameRing:
    """`window` reusable bucket buffers for frames; bucket `seq` is packed
    into slot seq % window. Reuse keeps the trainer's memory at window x bucket and spares
    the allocator (a fresh buffer per bucket costs page faults on every bucket)."""

    def __init__(self, slots: int) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * slots

    def slot(self, seq: int, nbytes: int) -> torch.Tensor:
        i = seq % len(self.bufs)
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[i] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]
