"""TRL's AsyncGRPOTrainer with its weight syncs going through weightsync.

    python -m examples.trl_grpo --model DIR --addr tcp://daemon:5555 \
        --server http://127.0.0.1:8000 [--steps 3] [--output-dir DIR] [--result out.json] \
        [--timeout 120] [--freeze NAME ...] [--canary] [--cpu]

The trainer is TRL's own (`trl.experimental.async_grpo.AsyncGRPOTrainer`, trl 1.16):
its rollout worker generates from the vLLM server at `--server`, scores with a reward
function, and trains; every weight sync (one cold sync at train start, then one per
optimizer step) is `WeightSyncTransfer.send_weights`, a weightsync push that returns once
every engine behind the daemon is READY at the next version. The vLLM server is fed by a
`weightsync engine --backend vllm-server --url URL --model DIR` attached to the daemon,
and is started with `--enable-scale-out` (the label read below); docs/INTEGRATIONS.md
(TRL) has the four commands of a run. A tokenizer without a chat template is given
Qwen3's in memory (`chat_tokenizer`).

Flags:
- `--model`, `--addr`, `--server`: the checkpoint directory TRL loads, the daemon's
  trainer address, the vLLM server's base URL (TRL's `vllm_server_base_url`).
- `--steps` (3): optimizer steps; `--output-dir`: TRL's; `--result`: where the JSON below
  is written; `--timeout` (120 s): the weightsync client's deadline for each wait.
- `--freeze NAME` (repeatable): set that parameter's `requires_grad=False` before training.
  TRL then leaves it out of every sync; the transfer is given `trainer.model`, so the
  first sync sends it and the later ones declare it unchanged.
- `--canary`: every sync also checks the engines' greedy answers against the trainer's
  own (`orchestrator.trainer.trl.canary`); a mismatch fails the sync (CANARY_MISMATCH).
- `--cpu`: run on a CPU host. TRL trains with its tree attention, whose kernel is
  FlashAttention-3 fetched from the Hugging Face kernels hub (CUDA only), and looks up the
  device's peak FLOPs with `torch.cuda`; this puts a torch SDPA implementation of the same
  varlen call (same arguments, causal, keys aligned to the end of each segment) and TRL's
  answer for an unknown device in their place; nothing else in TRL is touched.

What is recorded per sync (written to `--result` as JSON): the version committed, seconds,
bytes, the digest the engines hold, TRL's model version after the sync, and the weight
version the server puts on a generation made right after it (vLLM's token-in-token-out
route reports it; TRL's /v1/completions responses do not carry it).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from orchestrator.trainer.trl import WeightSyncTransfer, canary

PROMPTS = [f"w{i} w{i + 7} w{i + 3}" for i in range(10, 42)]
CANARY_PROMPTS = [[5, 9, 17], [40, 41]]  # token ids


def chat_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer for TRL's rollout worker. A tokenizer without a chat template
    (the tiny test Llama's) gets Qwen3's, in memory only (the model directory is not
    written): TRL's worker formats the prompts with it and refuses a tokenizer whose
    template it cannot parse responses of. A model's own template is kept as it is."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not tok.chat_template:
        tok.chat_template = qwen3_chat_template
    return tok


def distinct_words(completions: list[Any], **_: Any) -> list[float]:
    """The reward: how many different words a completion uses (varies across samples, so
    advantages are not all zero and every step changes the weights)."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else str(c)
        out.append(float(len(set(str(text).split()))))
    return out


def sdpa_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **_: Any,
) -> Any:
    """`flash_attn_varlen_func`'s contract in torch: per segment, queries attend to the
    segment's keys, causally with the queries aligned to the last keys."""
    import torch
    import torch.nn.functional as F

    if window_size != (-1, -1):
        raise NotImplementedError("sliding windows are not needed for a Llama")
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qa, qb = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ka, kb = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qs = q[qa:qb].transpose(0, 1)
        ks = k[ka:kb].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[ka:kb].transpose(0, 1).repeat_interleave(groups, 0)
        lq, lk = qb - qa, kb - ka
        mask = None
        if causal:
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)
        out[qa:qb] = o.transpose(0, 1)
    return out


def use_cpu(attention: bool = True) -> None:
    """The two CUDA-only calls AsyncGRPOTrainer makes on a CPU host, replaced: the device's
    peak-FLOPs lookup (`torch.cuda.get_device_name`; TRL answers None for a device it does
    not know, which turns its MFU metric off) and the FA3 kernel of its tree attention."""
    from types import SimpleNamespace

    from trl.experimental.async_grpo import async_grpo_trainer, packing

    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    if attention:
        packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=sdpa_varlen)


class ServerError(RuntimeError):
    """The vLLM server refused a request; the message carries the status and its body."""


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # urllib's message has the status only, not the server's reason
        detail = e.read().decode(errors="replace")[:2000]
        hint = ""
        if e.code in (403, 404) and "/inference/" in url:
            hint = " (vLLM serves the token-in-token-out route only when started with --enable-scale-out)"
        raise ServerError(f"POST {url}: HTTP {e.code} {e.reason}: {detail}{hint}") from None


def generation_label(server: str) -> list[str]:
    """The weight versions vLLM puts on a fresh generation (token-in-token-out route)."""
    r = _post(
        server + "/inference/v1/generate",
        {"token_ids": [1, 17, 42], "sampling_params": {"max_tokens": 2, "temperature": 0.0}},
    )
    spans = r["choices"][0].get("weight_versions") or []
    return [str(s["version"]) for s in spans]


class RecordingTransfer(WeightSyncTransfer):
    """WeightSyncTransfer that also writes down what each sync did."""

    def __init__(self, addr: str, server: str, **kw: Any) -> None:
        super().__init__(addr, **kw)
        self.server = server
        self.syncs: list[dict[str, Any]] = []
        self.trainer: Any = None

    def send_weights(self, iterator: Any) -> None:
        t0 = time.perf_counter()
        super().send_weights(iterator)
        seconds = time.perf_counter() - t0
        r = self.last
        if r is None:  # send_weights sets it or raises
            raise RuntimeError("no sync result")
        rec = {
            "version": self.version,
            "seconds": round(seconds, 4),
            "bytes": r.bytes,
            "buckets": r.buckets,
            "state": r.state,
            "sent_digest": r.digest,
            "engine_digests": {str(e.get("engine_id")): e.get("digest") for e in r.engines},
            "label_after": generation_label(self.server),
            "trl_version_before": self.trainer.model_version if self.trainer is not None else None,
        }
        self.syncs.append(rec)
        print(
            f"weightsync sync: version={rec['version']} seconds={rec['seconds']} bytes={rec['bytes']} "
            f"label_after={rec['label_after']}",
            flush=True,
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--output-dir", default="trl-grpo-out")
    p.add_argument("--result", default=None)
    p.add_argument("--cpu", action="store_true", help="replace the two CUDA-only calls (see use_cpu)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--freeze", action="append", default=[], metavar="NAME", help="freeze this parameter")
    p.add_argument("--canary", action="store_true", help="check the engines' greedy answers at each sync")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)

    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    if a.cpu:
        use_cpu()
    transfer = RecordingTransfer(a.addr, a.server, timeout=a.timeout)
    cfg = AsyncGRPOConfig(
        output_dir=a.output_dir,
        max_steps=a.steps,
        dtype="float32",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        vllm_server_base_url=a.server,
        vllm_server_timeout=120,
        weight_sync_steps=1,
        max_inflight_tasks=8,
        # a step takes 4 samples; TRL's default (1024) lets its rollout process generate
        # ahead without bound, competing with training for the CPU, and at exit the samples
        # nobody took keep that process from ending (TRL then waits 15 s and terminates it)
        queue_maxsize=16,
        use_cpu=True,
    )
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in PROMPTS])
    trainer = AsyncGRPOTrainer(
        model=a.model,
        processing_class=chat_tokenizer(a.model),
        reward_funcs=distinct_words,
        args=cfg,
        train_dataset=ds,
        weight_transfer=transfer,
    )
    transfer.trainer = trainer
    for name in a.freeze:  # before train() builds the optimizer
        trainer.model.get_parameter(name).requires_grad_(False)
    transfer.model = trainer.model  # the parameters TRL leaves out are taken from it
    if a.canary:
        transfer.probes = canary(trainer.model, CANARY_PROMPTS, 4)
    trainer.train()
    result = {
        "syncs": transfer.syncs,
        "trl_model_version": trainer.model_version,
        "log_history": trainer.state.log_history,
        "global_step": trainer.state.global_step,
    }
    text = json.dumps(result, default=str)
    if a.result:
        Path(a.result).write_text(text)
    print("RESULT " + text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
