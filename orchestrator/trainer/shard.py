"""A sharded push's assignment: which source (trainer rank) sends which tensor.

Rules: the plan is a pure function of the tensors' metadata (name, shape, dtype as sent)
and the number of sources, so every rank computes the same one without talking to the
others. It balances bytes: tensors from the largest down (name breaking ties) each go to
the source with the fewest bytes so far (the lowest rank breaking ties), the classic
longest-processing-time rule, within 4/3 of the best split. It is computed once per model
layout (`ShardPlans` keeps it by the metadata's signature) and replayed at every sync;
its hash (`messages.shardplan.plan_key`) rides in every source's `begin`: the daemon refuses
a source whose plan differs from the one the sync was opened with, and fails a sync whose
sources did not send exactly the tensors the plan gives each.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from messages.bounded import LRU
from messages.shardplan import plan_key

Meta = tuple[str, tuple[int, ...], str, int]  # name, shape, dtype (as sent), bytes


@dataclass(frozen=True, slots=True)
class ShardPlan:
    world: int
    owner: dict[str, int]  # tensor name -> the source that sends it
    loads: tuple[int, ...]  # bytes each source sends
    key: int  # xxh3-64 of the assignment: what `begin.plan` carries

    def mine(self, rank: int, name: str) -> bool:
        return self.owner.get(name) == rank

    @property
    def imbalance(self) -> float:
        """The busiest source's bytes over the mean (1.0: perfectly even)."""
        mean = sum(self.loads) / max(1, self.world)
        return max(self.loads) / mean if mean else 1.0


def plan_shards(metas: Iterable[Meta], world: int) -> ShardPlan:
    """Assign every tensor to one of `world` sources, balancing bytes (deterministic)."""
    if world < 1:
        raise ValueError("world must be >= 1")
    items = sorted(metas, key=lambda m: (-m[3], m[0]))
    names = [m[0] for m in items]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    heap = [(0, r) for r in range(world)]
    owner: dict[str, int] = {}
    loads = [0] * world
    for name, _, _, nbytes in items:
        load, r = heapq.heappop(heap)
        owner[name] = r
        loads[r] = load + nbytes
        heapq.heappush(heap, (loads[r], r))
    return ShardPlan(world, owner, tuple(loads), plan_key(world, owner))


def signature(metas: Iterable[Meta], world: int) -> int:
    """What a plan depends on, hashed: the same model layout and world give the same plan."""
    h = xxhash.xxh3_64()
    h.update(f"{world}\0".encode())
    for name, shape, dtype, nbytes in metas:
        h.update(f"{name}\0{shape}\0{dtype}\0{nbytes}\0".encode())
    return h.intdigest()


PLANS_KEPT = 4  # layouts a trainer pushes sharded (a model, its LoRA, ...): each planned once


class ShardPlans:
    """Plans by layout: computed at a model's first sharded push, replayed after."""

    def __init__(self, keep: int = PLANS_KEPT) -> None:
        self._plans: LRU[int, ShardPlan] = LRU(keep)
        self.computed = 0  # how many plans were computed (a replay computes none)

    def get(self, metas: list[Meta], world: int) -> ShardPlan:
        sig = signature(metas, world)
        plan = self._plans.get(sig)
        if plan is None:
            plan = plan_shards(metas, world)
            self.computed += 1
            self._plans[sig] = plan
        return plan
