"""The in-process vLLM engine: `vllm.LLM` hosted in the engine process, driven through
`collective_rpc` into `engines.vllm.extension.WeightSyncExtension` on every worker.

Rules: what both vLLM backends share is `engines.vllm.base`. vLLM reads its settings
from the process environment at import: the caller sets them first (the `weightsync
engine` command does, from `orchestrator.daemon.config.vllm_process_env`). LoRA slots
(`engines.vllm.lora`) keep adapter tensors out of vLLM's loader and add the adapter at
the single finalize.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import structlog
import xxhash

from engines.base import EngineOptions
from engines.vllm.base import EXTENSION, Parts, VllmBase
from engines.vllm.lora import LoraSlots, vllm_rank
from messages import transports
from messages.errors import ErrorCode, MessageError, make_error
from messages.schema import Probe, Ref, TensorMeta
from messages.segments import frombuffer

if TYPE_CHECKING:
    from typing_extensions import Buffer
    from vllm.lora.request import LoRARequest

    from messages.replies import Json, JsonObject

log = structlog.get_logger()

# Keyword arguments of `vllm.LLM` (--vllm-arg: JSON values): vLLM takes them as it likes
# (it is untyped here), and `_workers` reads its parallel sizes with int().
LlmArgs: TypeAlias = "dict[str, Any]"


class VllmEngine(VllmBase):
    """`vllm.LLM` in this process (its workers in-process or in vLLM's own processes)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        multiprocessing: bool = False,
        llm_args: LlmArgs | None = None,
        staging_bytes: int = 64 << 20,
        take_slices: bool = False,
    ) -> None:
        from vllm import LLM

        args: LlmArgs = {
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 256,
            "seed": 0,
            "enable_prefix_caching": True,
            **(llm_args or {}),
        }
        t0 = time.perf_counter()
        self.llm = LLM(model=str(model_dir), worker_extension_cls=EXTENSION, **args)
        self.startup_seconds = time.perf_counter() - t0
        self.llm_args = args
        self.multiprocessing = multiprocessing
        self._setup(model_dir, staging_bytes, take_slices=take_slices)
        self.lora_request: LoRARequest | None = None  # the adapter generations use (VllmLoraEngine)
        log.info(
            "vllm_started",
            model=self.model_dir,
            seconds=round(self.startup_seconds, 2),
            multiprocessing=multiprocessing,
            args=args,
        )

    def _extra(self) -> JsonObject:
        return {"llm_args": self.llm_args, "multiprocessing": self.multiprocessing}

    def _workers(self) -> int:
        return int(self.llm_args.get("tensor_parallel_size", 1)) * int(
            self.llm_args.get("pipeline_parallel_size", 1)
        )

    def rpc(self, method: str, arg: str = "{}") -> list[Json]:
        return list(self.llm.collective_rpc(method, args=(arg,)))

    def _after_finalize(self) -> None:
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _local(self) -> bool:
        return not self.multiprocessing

    def set_label(self, label: str) -> str:
        """vLLM's weight version: every token generated from now on carries it (spans on
        each finished output). Returns what the engine core now stamps on its outputs,
        read back from it (as the server backend reads `/weight_info`). Not a generation:
        one token through the model reads every weight once more, at each commit (28 ms
        of a 428 MB model's finish on this 2-core host)."""
        self.llm.llm_engine.set_weight_version(label)
        return str(self.llm.llm_engine.get_weight_version())

    def probe(self, probes: Sequence[Probe]) -> tuple[tuple[int, ...], ...]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p.prompt)) for p in probes]
        params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True) for p in probes]
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        return tuple(tuple(o.outputs[0].token_ids) for o in outs)

    def close(self) -> None:
        super().close()
        llm = self.__dict__.pop("llm", None)
        if not self.multiprocessing:
            # In-process workers: vLLM's shutdown tears down the process-global
            # torch.distributed groups, which would break any other in-process LLM
            # (measured). Dropping the reference is enough; the process owns the rest.
            return
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()  # stops vLLM's worker processes


class VllmLoraEngine(VllmEngine):
    """A vLLM engine that also serves one LoRA adapter (`--lora-rank`): adapter tensors stay
    here (`LoraSlots`) and are activated at finalize; the base model's reload starts only on
    the first base tensor, so an adapter-only sync never reloads the base."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lora_rank: int,
        lora_targets: Sequence[str] = (),
        llm_args: LlmArgs | None = None,
        multiprocessing: bool = False,
        staging_bytes: int = 64 << 20,
    ) -> None:
        lora_args = {"enable_lora": True, "max_lora_rank": vllm_rank(lora_rank), "max_loras": 1}
        super().__init__(
            model_dir,
            llm_args={**(llm_args or {}), **lora_args},
            multiprocessing=multiprocessing,
            staging_bytes=staging_bytes,
        )
        self.lora = LoraSlots(self.model_dir, self.spec, lora_rank, lora_targets)
        self.spec.update(self.lora.spec)
        self._readers: dict[str, transports.Reader] = {}  # per reference transport
        self._pending_begin: tuple[str, int] | None = None
        self._base_begun = False

    def begin(self, sync_id: str, version: int) -> None:
        self.sync_id, self._digest = sync_id, None
        self._pending_begin, self._base_begun = (sync_id, version), False
        self.lora.pending.clear()

    def _begin_base(self) -> None:
        if not self._base_begun and self._pending_begin is not None:
            super().begin(*self._pending_begin)
            self._base_begun = True

    def load_bucket(self, metas: Sequence[TensorMeta], buf: Buffer, parts: Parts = None) -> None:
        self._check(metas)
        base = self.lora.take(metas, frombuffer(memoryview(buf)))
        if base:
            self._begin_base()
            self._send_bucket(base, buf, _only(parts, base))

    def load_ref(
        self, metas: Sequence[TensorMeta], ref: Ref, bucket_checksum: int, parts: Parts = None
    ) -> None:
        self._check(metas)
        try:
            mv = transports.view(ref, self._readers)
        except MessageError as exc:
            raise make_error(exc.code, exc.reason) from None
        base = self.lora.take(metas, frombuffer(mv))
        if base:
            self._begin_base()
            self._send_ref(base, ref, bucket_checksum, _only(parts, base))

    def load_group(
        self,
        metas: Sequence[TensorMeta],
        group: JsonObject,
        size: int,
        bucket_checksum: int,
        bind: str,
        seq: int | None = None,
        next_bucket: dict[str, int] | None = None,
        mac: tuple[str, int, str] | None = None,
    ) -> None:
        if any(m.name in self.lora.spec for m in metas):
            raise make_error(
                ErrorCode.BAD_MESSAGE,
                f"LoRA adapters travel as frames or by reference, not by a group (push them "
                f"with transport {transports.FRAMES}|{transports.AUTO})",
            )
        self._begin_base()
        super().load_group(metas, group, size, bucket_checksum, bind, seq, next_bucket, mac)

    def finalize(self, sync_id: str) -> str:
        parts: list[str | None] = []
        if self._base_begun:
            parts.append(super().finalize(sync_id))
        else:
            self.finalize_count += 1
        if self.lora.pending:
            self.lora_request = self.lora.activate(
                self.llm, self._pending_begin[1] if self._pending_begin else 0
            )
            parts.append(self.lora.digest)
        self._pending_begin = None
        one = parts[0] if len(parts) == 1 else None
        out = one if one is not None else xxhash.xxh3_128_hexdigest("".join(p or "" for p in parts).encode())
        self._digest = out
        return out

    def abort(self) -> None:
        if self._base_begun:
            super().abort()
        self.lora.pending.clear()
        self._pending_begin, self._base_begun, self._digest = None, False, None

    def close(self) -> None:
        self.lora.close()
        transports.close_readers(self._readers)
        super().close()


def _only(parts: Parts, metas: Sequence[TensorMeta]) -> Parts:
    return None if parts is None else {m.name: parts[m.name] for m in metas}


def make_engine(options: EngineOptions) -> VllmEngine:
    multiprocessing = bool(options.get("vllm_mp", False))
    llm_args = options.get("llm_args") or {}
    rank = int(options.get("lora_rank") or 0)
    if rank:
        targets = tuple(options.get("lora_targets") or ())
        return VllmLoraEngine(
            options["model"],
            lora_rank=rank,
            lora_targets=targets,
            multiprocessing=multiprocessing,
            llm_args=llm_args,
        )
    return VllmEngine(
        options["model"],
        multiprocessing=multiprocessing,
        llm_args=llm_args,
        take_slices=bool(options.get("vllm_slices", False)),
    )
