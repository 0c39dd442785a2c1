"""A small, real RL loop: a tiny Llama learns to emit a target token, with every step's
weights pushed through weightsync into a real vLLM engine that samples the next batch.

    python -m examples.rl_loop --steps 8

What it does, step by step (a GRPO-style update, the shape TRL / verl loops have):
1. vLLM (in this process, colocated as in TRL's colocate mode) samples a group of
   completions for one prompt at temperature 1.
2. Reward: the fraction of completion tokens equal to the target token (by default one the
   initial policy emits most often, still rare). Advantages are rewards minus the group mean.
3. The trainer (a plain transformers model with AdamW) takes one policy-gradient step.
4. `client.push_module(model, version)` streams the new weights to the engine; the push
   carries a greedy canary computed by the trainer's own model, so the daemon reaches READY
   only if the engine's greedy output equals the trainer's.
5. `client.wait_ready(version)` returns once every engine serves that version; sampling
   resumes on the new policy (on-policy; an off-policy trainer would wait for
   `version - max_staleness` instead).

The engine process here is this process: `Worker` runs the weightsync engine loop on a
thread around the same `VllmEngine` that samples, so no weights are copied by hand.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from pathlib import Path
from typing import Any

PROMPT = (1, 17, 42, 99, 7)


def sample(
    engine: Any, prompt: tuple[int, ...], n: int, max_tokens: int, seed: int, with_outputs: bool = False
) -> Any:
    """n completions (token lists); with_outputs: vLLM's outputs too (their version labels)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
    tokens = [list(c.token_ids) for c in out[0].outputs]
    return (tokens, out[0].outputs) if with_outputs else tokens


def policy_step(
    model: Any, opt: Any, prompt: tuple[int, ...], completions: list[list[int]], rewards: list[float]
) -> float:
    import torch

    adv = torch.tensor(rewards) - sum(rewards) / len(rewards)
    ids = torch.tensor([list(prompt) + c for c in completions])
    logits = model(ids).logits[:, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt) :, None]).squeeze(-1)
    loss = -(adv[:, None] * logp).sum(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def pick_target(engine: Any, prompt: tuple[int, ...], max_tokens: int) -> int:
    """The token the initial policy emits most often (a random model is close to uniform,
    so still rare): a group of samples finds it, and the reward has room to grow."""
    from collections import Counter

    counts = Counter(t for c in sample(engine, prompt, 128, max_tokens, seed=0) for t in c)
    return counts.most_common(1)[0][0]


def run(
    steps: int = 8,
    group: int = 64,
    max_tokens: int = 8,
    target: int = -1,
    lr: float = 0.05,
    workdir: Path | None = None,
    log: Any = print,
    delta: bool = False,
) -> dict[str, Any]:
    import torch

    from engines.torch_engine import load_model
    from engines.vllm.engine import VllmEngine
    from engines.worker import Worker
    from examples.launch import Cluster
    from examples.tiny import build_tiny_llama
    from messages.canary import make_probes
    from orchestrator.daemon.config import set_process_env, vllm_process_env
    from orchestrator.trainer.rollout import oldest_version, too_stale

    tmp = tempfile.TemporaryDirectory(prefix="weightsync-rl-") if workdir is None else None
    work = Path(tmp.name if tmp else workdir)
    model_dir = build_tiny_llama(work / "model", seed=0)
    cluster = Cluster(work, model_dir, engines=0, min_engines=1)
    set_process_env(vllm_process_env(False))  # before vLLM is imported
    engine = VllmEngine(model_dir)  # the rollout engine, in this process
    worker = Worker(engine, cluster.engine_addr, "rollout-0", close_engine=False, delta_base=delta)
    history: list[dict[str, Any]] = []
    try:
        cluster.start_daemon()
        thread = threading.Thread(target=worker.run, name="weightsync-engine", daemon=True)
        thread.start()
        cluster.wait_engines(1, timeout=120)
        if target < 0:
            target = pick_target(engine, PROMPT, max_tokens)
        log(json.dumps({"target": target}))
        model = load_model(model_dir).train()  # the policy being trained (fp32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        with cluster.client(timeout=120.0) as client:
            for step in range(1, steps + 1):
                completions, outputs = sample(engine, PROMPT, group, max_tokens, seed=step, with_outputs=True)
                # every sample is labelled with the version that generated it: on-policy here,
                # so none may be older than the last push (an async loop would allow a lag)
                # (step 1 samples the initial weights, which no commit labelled)
                versions = sorted({oldest_version(o) for o in outputs}) if step > 1 else []
                if step > 1:
                    keep = [not too_stale(o, step - 1, max_lag=0) for o in outputs]
                    completions = [c for c, k in zip(completions, keep, strict=True) if k]
                rewards = [sum(t == target for t in c) / max_tokens for c in completions]
                loss = policy_step(model, opt, PROMPT, completions, rewards)
                model.eval()
                probes = make_probes(model, [PROMPT], max_tokens)  # the trainer's own greedy answer
                r = client.push_module(model, step, probes=probes, bucket_bytes=256 * 1024, delta=delta)
                client.wait_ready(step)
                served = engine.generate([PROMPT], max_tokens)[0]  # the engine, after the push
                model.train()
                row = {
                    "step": step,
                    "reward": sum(rewards) / len(rewards),
                    "loss": round(loss, 4),
                    "push_s": round(r.seconds, 3),
                    "greedy_matches": served == probes[0].expected,
                    "sample_versions": versions,  # the labels on this step's samples
                    "bytes": r.bytes,  # on the wire (a delta push: its patches)
                }
                if delta:  # what a dense push of the same step would have sent, and how
                    d = r.detail["delta"]
                    row.update(dense_bytes=d["dense_bytes"], delta_base=d["base"], kinds=d["tensors"])
                history.append(row)
                log(json.dumps(row))
    finally:
        worker.request_stop()
        cluster.stop()
        engine.close()
        if tmp is not None:
            tmp.cleanup()
    first, last = history[0]["reward"], history[-1]["reward"]
    return {
        "history": history,
        "target": target,
        "reward_first": first,
        "reward_last": last,
        "all_greedy_match": all(h["greedy_matches"] for h in history),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m examples.rl_loop", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--group", type=int, default=64, help="completions sampled per step")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--target",
        type=int,
        default=-1,
        help="the token the reward asks for (-1: the one the initial policy emits most)",
    )
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--delta", action="store_true", help="push each step as a delta (prints bytes beside dense)"
    )
    args = ap.parse_args(argv)
    out = run(args.steps, args.group, args.max_tokens, args.target, args.lr, delta=args.delta)
    print("RESULT " + json.dumps({k: v for k, v in out.items() if k != "history"}))
    if not out["all_greedy_match"]:
        raise SystemExit(4)


if __name__ == "__main__":
    main()
