"""A real `trl.experimental.async_grpo.AsyncGRPOTrainer` (trl 1.16) training a tiny Llama
for a few optimizer steps, its weight syncs through `WeightSyncTransfer` to a running
weightsync daemon. Only the rollouts are TRL's documented seam: an in-process rollout
worker (`RolloutWorkerProtocol`, which TRL's own tests stub the same way) hands it scored
samples instead of a vLLM server, so no vLLM runs. TRL's trainer, loss, optimizer step and
weight sync (`_sync_weight`: pause, `send_weights(_streaming_iter())`, resume, and the
names and frozen-parameter filter of `_iter_vllm_named_params`) are TRL's, unchanged
except the two CUDA-only calls `examples.trl_grpo.use_cpu` replaces.

    python -m tests.integration.trl_run ADDR MODEL_DIR RESULT_JSON [--steps N]
        [--freeze NAME ...] [--canary] [--lora]

Writes RESULT_JSON: each sync's version, bytes and engines' digests, TRL's log history
(grad_norm per step), and digests of the trainer's weights before and after training."""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
from pathlib import Path
from typing import Any

import numpy as np

from examples.trl_grpo import distinct_words, use_cpu
from messages.buckets import digest
from orchestrator.trainer.trl import WeightSyncTransfer, canary, trl_name

PROMPT_LEN, COMPLETION_LEN, GENERATIONS = 4, 4, 4


class StubRollouts:
    """`RolloutWorkerProtocol`: at start and after each sync, two prompt groups of random
    completions tagged with the version now live, advantages +1/-1 within each group and
    old log-probs near the model's (so the loss's ratio is near 1 and unclipped)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[Any] = queue.Queue()
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.version = 0
        self.group = 0

    def start(self) -> None:
        self._fill()

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.version = model_version
        self._fill()

    def check_health(self, stale_after_s: float) -> None:
        pass

    def _fill(self) -> None:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        for _ in range(2):
            self.group += 1
            prompt = [self.rng.randrange(4, self.vocab) for _ in range(PROMPT_LEN)]
            for g in range(GENERATIONS):
                completion = [self.rng.randrange(4, self.vocab) for _ in range(COMPLETION_LEN)]
                n = PROMPT_LEN + COMPLETION_LEN
                self.rollout_buffer.put(
                    RolloutSample(
                        prompt=[{"role": "user", "content": "p"}],
                        completion=[{"role": "assistant", "content": "c"}],
                        input_ids=np.asarray(prompt + completion, dtype=np.int64),
                        completion_mask=np.asarray([0] * PROMPT_LEN + [1] * COMPLETION_LEN, dtype=np.int64),
                        old_log_probs=np.full(n, -math.log(self.vocab), dtype=np.float32),
                        advantage=1.0 if g % 2 == 0 else -1.0,
                        model_version=self.version,
                        group_id=self.group,
                        metrics={"reward": float(g % 2)},
                    )
                )


class RecordingTransfer(WeightSyncTransfer):
    def __init__(self, addr: str, **kw: Any) -> None:
        super().__init__(addr, **kw)
        self.syncs: list[dict[str, Any]] = []

    def send_weights(self, iterator: Any) -> None:
        super().send_weights(iterator)
        r = self.last
        if r is None:
            raise RuntimeError("no sync result")
        self.syncs.append(
            {
                "version": r.version,
                "state": r.state,
                "bytes": r.bytes,
                "sent_digest": r.digest,
                "engine_digests": {str(e.get("engine_id")): e.get("digest") for e in r.engines},
            }
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("model")
    p.add_argument("result")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--freeze", action="append", default=[])
    p.add_argument("--canary", action="store_true")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft_config)")
    a = p.parse_args(argv)

    from datasets import Dataset
    from transformers import AutoConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    use_cpu()
    transfer = RecordingTransfer(a.addr, timeout=60.0)
    cfg = AsyncGRPOConfig(
        output_dir=str(Path(a.result).parent / "trl-out"),
        max_steps=a.steps,
        dtype="float32",
        per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION_LEN,
        learning_rate=5e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        weight_sync_steps=1,
        token_budget=0,  # fixed-count batches: no server to ask for its max_model_len
        use_cpu=True,
    )
    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"w{i}"}]} for i in range(16)])
    trainer = AsyncGRPOTrainer(
        model=a.model,  # TRL 1.16 loads the model itself (a path)
        reward_funcs=distinct_words,
        args=cfg,
        train_dataset=ds,
        weight_transfer=transfer,
        rollout_worker=StubRollouts(AutoConfig.from_pretrained(a.model).vocab_size),
        peft_config=peft_config,
    )
    model = trainer.model
    for name in a.freeze:  # frozen before train() builds the optimizer
        model.get_parameter(name).requires_grad_(False)
    transfer.model = model  # what TRL's iterator leaves out is taken from here
    if a.canary:
        transfer.probes = canary(model, [[5, 9, 17], [40, 41]], 4)

    def weights(trainable: bool | None = None) -> str:
        """Under TRL's names; a PEFT model's adapter tensors left out (they are in the base)."""
        return digest(
            (trl_name(n), p.detach())
            for n, p in model.named_parameters()
            if (trainable is None or p.requires_grad == trainable) and (trainable or "lora_" not in n)
        )

    before = {"trainable": weights(True), "frozen": weights(False)}
    trainer.train()
    out = {
        "syncs": transfer.syncs,
        "unchanged": sorted(transfer.unchanged),
        "global_step": trainer.state.global_step,
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "before": before,
        "after": {"trainable": weights(True), "frozen": weights(False), "all": weights()},
    }
    if a.lora:  # what TRL sends: the base weights with the adapter merged in
        model.merge_adapter()
        out["after"]["merged"] = weights()
        model.unmerge_adapter()
    Path(a.result).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
