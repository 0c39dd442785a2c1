"""A sharded push's plan hash: what `begin.plan` is, so the daemon can check it.

Rules: the hash of an assignment (tensor name -> the source that sends it) is xxh3-64 over
`"{world}\\0"` then `"{name}\\0{source}\\0"` for each name in sorted order. The trainer hashes
the plan it computed (orchestrator/trainer/shard.py); the daemon hashes what the sources
actually sent and compares, so a tensor sent by a source the plan does not give it, or a
planned tensor nobody sent, fails the sync before any engine finalizes.
"""

from __future__ import annotations

from collections.abc import Mapping

import xxhash


def plan_key(world: int, owner: Mapping[str, int]) -> int:
    """The hash of the assignment `owner` (tensor name -> source) among `world` sources."""
    h = xxhash.xxh3_64()
    h.update(f"{world}\0".encode())
    for name in sorted(owner):
        h.update(f"{name}\0{owner[name]}\0".encode())
    return h.intdigest()
