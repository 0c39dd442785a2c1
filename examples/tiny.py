"""Tiny random causal LMs saved locally (no model hub is reachable): demo and tests.

Rules: deterministic from (size, seed); written with `save_pretrained` (safetensors) plus
a small word-level tokenizer, so transformers and vLLM both load the directory offline.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

SIZES: dict[str, dict[str, int]] = {
    # ~0.4M parameters: fast enough for tests on two cores
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
    },
    # ~10M parameters (~40 MB fp32): the demo, big enough to measure throughput
    "small": {
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 2048,
    },
    # ~107M parameters (~430 MB fp32): benchmarks, where per-sync fixed costs must amortize
    "medium": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
    },
}

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<think>", "</think>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(vocab_size: int):
    """A word-level fast tokenizer with the chat/thinking specials and `vocab_size` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS) - 2)] + ["\n", "\n\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[4:]})
    return fast


def build_tiny_llama(
    path: str | Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a random Llama of `size` into `path` (embeddings tied to the LM head with `tie`,
    stored in `dtype`) and return the path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype=str(dtype).removeprefix("torch."),
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        # HF's default init is near-zero for a random model; a wider spread makes greedy
        # decoding depend visibly on every layer (so a corrupted layer changes the output).
        with torch.no_grad():
            for _name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08)
    model.to(dtype).save_pretrained(path)
    build_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


def perturbed(
    state: dict[str, torch.Tensor], version: int, scale: float = 0.02
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a trainer step would produce: `state` plus deterministic noise for `version`."""
    g = torch.Generator().manual_seed(1000 + version)
    for name, t in state.items():
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
        yield name, (t + scale * noise).contiguous()


def build_tiny_moe(path: str | Path, *, kind: str = "qwen3_moe", seed: int = 0) -> Path:
    """A random MoE (Qwen3-MoE or Mixtral config, head_dim 32, 4 experts, top-2)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    common = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "num_experts_per_tok": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
    }
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            **common, moe_intermediate_size=64, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[]
        )
        cls = Qwen3MoeForCausalLM
    elif kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(**common, num_local_experts=4)
        cls = MixtralForCausalLM
    else:
        raise ValueError(f"unknown MoE kind {kind!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    build_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


def save_checkpoint_like(src: str | Path, dst: str | Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of model directory `src` whose weights are `tensors` (checkpoint names)."""
    import shutil

    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return dst
