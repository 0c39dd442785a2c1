"""TRL's weight-transfer protocol over weightsync: `WeightSyncTransfer(addr)` is the object
an AsyncGRPO-style trainer calls (`init_weight_transfer`, `pause`, `send_weights`,
`resume`, `destroy`), so its weight syncs get weightsync's guarantees.

Rules:
- `send_weights(iterator)` streams the (name, tensor) pairs in order as one push of the
  next version and returns only when every engine is READY at it (each finalized once,
  digests equal, canaries if given); any failure raises (a `WeightSyncError` with its
  code), never a silent return; the client's deadlines bound every wait, so it never
  hangs. `.version` is the version it last committed: the label vLLM engines put on what
  they generate from then on.
- Frozen parameters: TRL's iterator leaves out every parameter with `requires_grad=False`
  (a non-PEFT model). Given `model=` (the module TRL trains), the first `send_weights` of
  this object also sends those, as one full push (a tensor no one sent is INCOMPLETE_SYNC,
  and the engines' digests are checked against everything); every later one is a partial
  push that declares exactly them unchanged: a tensor the first sync carried that is
  neither in the iterator nor frozen then is INCOMPLETE_SYNC, raised before the finish,
  so nothing is committed. Without `model=`, every push is full (a frozen part fails it).
- `probes`: canaries every engine must answer after its post-load step (else
  CANARY_MISMATCH and nothing is committed); a callable is called at each
  `send_weights`, so its expected answers are those of the weights being sent
  (`canary(model, prompts)`).
- `pause` and `resume` send nothing: a weightsync engine pauses its own server for the
  sync (`weightsync engine --pause-mode`) and resumes it once its post-load step ran, so
  no request sees half-loaded weights whatever the trainer does between the calls.
- Versions continue from what the fleet serves: a trainer restarted against a running
  fleet commits the next version, never one it already served.
- This module imports no TRL: the protocol is structural.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypedDict, Unpack, cast

import torch

from messages.canary import make_probes
from messages.errors import ErrorCode, make_error
from messages.schema import Probe
from orchestrator.trainer.client import ConnectOptions, SyncResult, TrainerClient

Probes = Sequence[Probe] | Callable[[], Sequence[Probe]]


class _AttentionSwitch(Protocol):
    """What `canary` uses of a transformers model (transformers is not a dependency)."""

    @property
    def config(self) -> object: ...

    def set_attn_implementation(self, impl: str | None) -> None: ...


class _PushOptions(TypedDict, total=False):
    """The push options a `WeightSyncTransfer` keeps (`TrainerClient.push`'s)."""

    transport: str
    window: int | None
    bucket_bytes: int


def trl_name(name: str) -> str:
    """A parameter's name as TRL streams it (its `_iter_vllm_named_params`): the DDP,
    activation-checkpointing and PEFT wrappers' parts removed, the checkpoint's name left."""
    name = name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace("modules_to_save.default.", "")


def frozen_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of `model` with `requires_grad=False`, under TRL's names; a PEFT
    model's adapter tensors (which vLLM never holds) and `original_module` copies left out."""
    peft_prefix = getattr(model, "prefix", None) if hasattr(model, "peft_config") else None
    for name, p in model.named_parameters():
        if p.requires_grad or "original_module" in name:
            continue
        if peft_prefix and peft_prefix in name:
            continue
        yield trl_name(name), p.detach()


def canary(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_tokens: int = 8
) -> Callable[[], list[Probe]]:
    """`probes=` for WeightSyncTransfer: at each sync, `model`'s own greedy answer to each
    prompt (token ids), which every engine must reproduce after its post-load step. Under
    TRL, `send_weights` runs with a PEFT adapter merged, so the answer is the merged one's.
    A model set to an attention that needs packing metadata (TRL's tree attention) decodes
    with torch's SDPA over the same weights, and is set back."""

    hf = cast(_AttentionSwitch, model)  # a transformers model (untyped here)

    def probes() -> list[Probe]:
        impl = getattr(hf.config, "_attn_implementation", None)
        switch = impl not in (None, "eager", "sdpa")
        if switch:
            hf.set_attn_implementation("sdpa")
        try:
            return make_probes(model, prompts, max_tokens)
        finally:
            if switch:
                hf.set_attn_implementation(impl)

    return probes


class WeightSyncTransfer:
    def __init__(
        self,
        addr: str,
        *,
        model: torch.nn.Module | None = None,
        delta: bool = False,
        transport: str = "auto",
        bucket_bytes: int | None = None,
        window: int | None = None,
        probes: Probes = (),
        **client_options: Unpack[ConnectOptions],
    ) -> None:
        self.addr = addr
        self.model = model  # the module TRL trains, for its frozen parameters (see Rules)
        self.client_options = client_options
        self.push_options: _PushOptions = {"transport": transport, "window": window}
        if bucket_bytes is not None:
            self.push_options["bucket_bytes"] = bucket_bytes
        self.probes = probes
        self.delta = delta
        self.client: TrainerClient | None = None
        self.version: int | None = None  # the version last committed (None: none yet)
        self.last: SyncResult | None = None
        # after the first committed sync with `model`: every name it carried, and the
        # frozen ones among them that TRL's iterator leaves out (declared unchanged since)
        self.names: frozenset[str] | None = None
        self.unchanged: frozenset[str] = frozenset()

    def init_weight_transfer(self) -> None:
        """Connect to the daemon and learn the version the fleet serves."""
        if self.client is None:
            self.client = TrainerClient(self.addr, **self.client_options)
        self.version = self.client.fleet().last_ready_version

    def pause(self) -> None:
        """Nothing to send: each engine pauses its own server during the sync."""

    def resume(self) -> None:
        """Nothing to send: each engine resumed when its post-load step ran."""

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One push of the next version; returns when every engine is READY at it."""
        if self.client is None:
            self.init_weight_transfer()
        client = self.client
        if client is None:  # init_weight_transfer sets it; for the type checker
            raise RuntimeError("weightsync client not connected")
        probes = tuple(self.probes() if callable(self.probes) else self.probes)
        seen: set[str] = set()  # every name this push carries
        from_trl: set[str] = set()  # those of them TRL's iterator gave
        first = self.model is not None and self.names is None
        if self.model is None:
            items: Iterable[tuple[str, torch.Tensor]] = iterator
        elif first:
            items = self._with_frozen(iterator, from_trl, seen, dict(frozen_parameters(self.model)))
        else:
            items = self._checked(iterator, seen)
        r = client.push(
            items,
            client.next_version(self.version),
            delta=self.delta,
            probes=probes,
            partial=not first and bool(self.unchanged),
            **self.push_options,
        )
        if first:  # committed: the frozen set is fixed from now on
            self.names, self.unchanged = frozenset(seen), frozenset(seen - from_trl)
        self.version, self.last = r.version, r

    @staticmethod
    def _with_frozen(
        iterator: Iterable[tuple[str, torch.Tensor]],
        from_trl: set[str],
        seen: set[str],
        frozen: dict[str, torch.Tensor],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """TRL's pairs, then the frozen parameters it left out (the first sync)."""
        for name, t in iterator:
            from_trl.add(name)
            seen.add(name)
            yield name, t
        for name, t in frozen.items():
            if name not in seen:
                seen.add(name)
                yield name, t

    def _checked(
        self, iterator: Iterable[tuple[str, torch.Tensor]], seen: set[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """TRL's pairs; at their end, refuse a push that leaves out a tensor not declared
        unchanged (raised inside the push, which aborts its sync: nothing is committed)."""
        for name, t in iterator:
            seen.add(name)
            yield name, t
        missing = sorted((self.names or frozenset()) - seen - self.unchanged)
        if missing:
            raise make_error(
                ErrorCode.INCOMPLETE_SYNC,
                f"send_weights left out {len(missing)} tensor(s) the first sync sent that were "
                f"not frozen then: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                "(a frozen set is fixed at the first sync of a WeightSyncTransfer)",
                details={"missing": missing[:64], "missing_count": len(missing)},
            )

    def destroy(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
