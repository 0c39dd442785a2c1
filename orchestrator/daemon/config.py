"""Settings: flags, then WEIGHTSYNC_* environment variables, then defaults, resolved once
into a frozen object. The only module that reads or writes the process environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from messages.schema import DEFAULT_ADDR, DEFAULT_ENGINE_ADDR

__all__ = ["DEFAULT_ADDR", "DEFAULT_ENGINE_ADDR", "ConfigError", "Settings", "load_settings"]
ENV_PREFIX = "WEIGHTSYNC_"


class ConfigError(ValueError):
    """A setting could not be parsed (exit code 2)."""


@dataclass(frozen=True, slots=True)
class Settings:
    bind: str = DEFAULT_ADDR
    engine_bind: str = DEFAULT_ENGINE_ADDR
    # the fan-out engines take buckets from, by frame or by reference (one publish per bucket):
    # "" = beside the engine socket (ipc://P.fanout, or tcp port + 1), "off" = none
    fanout_bind: str = ""
    # bytes of published buckets queued for one fan-out connection; past it that connection
    # misses messages (a frozen engine, a subscriber that never reads): the daemon's memory
    # bound per such connection. Trainers' windows are kept within it (messages.fanout).
    fanout_queue_bytes: int = 192 << 20
    state_db: str = "weightsync-state.db"
    min_engines: int = 1
    engine_timeout: float = 15.0
    # seconds a LOST engine's record (status, metrics, routing) is kept; then it is forgotten
    lost_expiry: float = 3600.0
    heartbeat_interval: float = 1.0
    sync_timeout: float = 300.0
    bucket_timeout: float = 300.0
    finalize_timeout: float = 600.0
    trainer_grace: float = 2.0  # a sync outlives its trainer's closed connection this long
    # an engine outlives its closed connection this long (one that says goodbye: none)
    engine_grace: float = 2.0
    shm_dir: str = "/dev/shm"  # shared-memory segments (a private tmpfs works too)
    metrics_bind: str = ""  # HOST:PORT for Prometheus metrics over HTTP ("" = off)
    max_header_bytes: int = 16 * 1024 * 1024
    max_frame_bytes: int = 4 * 1024**3  # one bucket's bytes; ZeroMQ drops a peer past 2x
    max_pending: int = 64  # unanswered bucket requests per trainer connection
    keys: str = ""  # CURVE keys directory ("" = no authentication; see messages/keys.py)
    spool: str = ""  # directory for the last READY version's buckets ("" = no rollback)
    failpoints: str = ""  # fault injection for tests: "name=value,..." (see parse_failpoints)
    log_level: str = "info"
    log_json: bool | None = None  # None: JSON when stderr is not a TTY


def _parse(value: str, default: object, name: str) -> bool | int | float | str:
    kind = type(default)
    try:
        if (
            isinstance(default, bool)
            or default is None
            and value.lower() in ("1", "0", "true", "false", "yes", "no")
        ):
            return value.lower() in ("1", "true", "yes", "on")
        if kind is int:
            return int(value)
        if kind is float:
            return float(value)
        return value
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={value!r} is not a valid {kind.__name__}") from None


def load_settings(**overrides: object) -> Settings:
    """Flags (non-None overrides) win over WEIGHTSYNC_* variables, which win over defaults."""
    base = Settings()
    values: dict[str, Any] = {}  # each of its field's type (`_parse`)
    for f in fields(Settings):
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        if env is not None:
            values[f.name] = _parse(env, getattr(base, f.name), f.name)
    for k, v in overrides.items():
        if v is not None:
            if k not in {f.name for f in fields(Settings)}:
                raise ConfigError(f"unknown setting {k!r}")
            values[k] = v
    settings = replace(base, **values)
    if settings.min_engines < 0 or settings.engine_timeout <= 0 or settings.lost_expiry <= 0:
        raise ConfigError("min_engines must be >= 0 and timeouts > 0")
    if min(settings.max_header_bytes, settings.max_frame_bytes, settings.max_pending) <= 0:
        raise ConfigError("max_header_bytes, max_frame_bytes and max_pending must be > 0")
    if settings.fanout_queue_bytes < 1 << 20:
        raise ConfigError("fanout_queue_bytes must be >= 1 MiB")
    parse_failpoints(settings.failpoints)
    return settings


FAILPOINTS = {
    "duplicate_finalize": "daemon: send every finalize to its engine twice",
    "finalize_sleep": "engine: sleep this many seconds before the post-load step",
    "drop_weights_after": "engine: once its Nth post-load step was reported, zero every weight it "
    "holds, its recorded digest unchanged (a server that slept and woke without its weights)",
    "finalize_twice": "engine: run the post-load step a second time once the first one's "
    "digest was reported (the bug the finalize guard stops, past the guard)",
    "crash_on_loaded": "daemon: raise inside the handler of the Nth engine `loaded` message",
    "kill_after_persisted": "daemon: SIGKILL itself once the journal/spool writes of the batch "
    "caused by this message type (begin, finish, loaded, ...) are durable",
    "kill_after_told": "daemon: SIGKILL itself once the engines were told of that batch, before any reply",
    "kill_in_broadcast": "engine: SIGKILL itself as it joins the broadcast of bucket seq N "
    "(a group transport; on the stream: its header read, its receive not yet posted), "
    "leaving the trainer mid-broadcast",
    "fail_slices_at": "engine (one that takes slices): fail, as its ranks load, the Nth bucket that "
    "holds a box since it started, with some of its ranks' slices of that bucket written",
    "kill_in_receive": "engine: SIGKILL itself with the receive of stream bucket seq N posted "
    "(blocked inside the broadcast)",
}


def parse_failpoints(text: str) -> dict[str, Any]:
    """`"a=1,b,c=finish"` -> {"a": 1.0, "b": 1.0, "c": "finish"}; unknown names are a
    ConfigError."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        if name not in FAILPOINTS:
            raise ConfigError(f"unknown failpoint {name!r} (known: {', '.join(FAILPOINTS)})")
        if name.startswith("kill_after_"):
            out[name] = value
            continue
        try:
            out[name] = float(value) if value else 1.0
        except ValueError:
            raise ConfigError(f"failpoint {name}: {value!r} is not a number") from None
    return out


def env_value(name: str, default: str | None = None) -> str | None:
    """A WEIGHTSYNC_* variable that is not a daemon setting (engine and client options)."""
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def columns_set() -> bool:
    """COLUMNS names a width (what rich, like most tools, then draws tables to)."""
    return os.environ.get("COLUMNS", "").strip().isdigit()


def set_process_env(values: dict[str, str]) -> None:
    """Set variables that a library reads at import (vLLM, HF) before importing it."""
    for k, v in values.items():
        os.environ[k] = v


def vllm_process_env(multiprocessing: bool, kv_cache_gib: int | None = None) -> dict[str, str]:
    """What vLLM reads at import, with our defaults for a CPU host (set before importing it).

    A value the user already exported wins, except the multiprocessing switch, which
    is the engine's explicit `--vllm-mp/--no-vllm-mp` choice.
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib or 1),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for k, v in defaults.items():
        env[k] = os.environ.get(k, v)
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a subprocess we start (demo, tests): ours plus `extra`."""
    env = dict(os.environ)
    env.update(extra or {})
    return env
