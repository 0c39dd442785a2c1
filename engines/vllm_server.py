"""`--backend vllm-server`: attach to a vLLM OpenAI server already running on this host.

The server must be started with `--worker-extension-cls
engines.vllm_extension.WeightSyncExtension` and `VLLM_SERVER_DEV_MODE=1` (that exposes
`/collective_rpc`, `/reset_prefix_cache`, `/pause`, `/resume`). Buckets travel through
shared memory exactly as for the in-process engine; only descriptors (JSON strings) go
over HTTP. Generation is paused from `begin` until finalize is done, with the configured
mode for in-flight requests (keep: frozen and resumed; wait: drained first; abort).
Probes run after `resume` (a paused server cannot generate), so between resume and the
orchestrator's READY the server already answers with the new, finalized weights.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import structlog

from engines.vllm_engine import _VllmBase
from messages.errors import ErrorCode, make_error
from messages.schema import Probe

log = structlog.get_logger()

PAUSE_MODES = ("keep", "wait", "abort")


class VllmServerEngine(_VllmBase):
    backend = "vllm-server"

    def __init__(self, model_dir: str | Path, url: str, *, pause_mode: str = "keep",
                 timeout: float = 600.0, staging_bytes: int = 64 << 20) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.url = url.rstrip("/")
        self.pause_mode = pause_mode
        self.timeout = timeout
        models = self._http("GET", "/v1/models")
        self.served_model = models["data"][0]["id"]
        try:
            self.workers = self.rpc("ws_info")
        except RuntimeError as exc:
            raise RuntimeError(
                f"{self.url} does not run the weightsync extension ({exc}); start it with "
                "--worker-extension-cls engines.vllm_extension.WeightSyncExtension and "
                "VLLM_SERVER_DEV_MODE=1") from None
        self._setup(model_dir, staging_bytes)
        self.finalize_count = min(w["finalize_count"] for w in self.workers)
        self.paused = False
        log.info("vllm_server_attached", url=self.url, model=self.served_model,
                 workers=len(self.workers), pause_mode=pause_mode)

    def _http(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise make_error(ErrorCode.ENGINE_FAILED, f"{self.url} unreachable: {exc.reason}") from None
        return json.loads(raw) if raw else None

    def _extra(self) -> dict[str, Any]:
        return {"url": self.url, "served_model": self.served_model, "pause_mode": self.pause_mode,
                "workers": len(self.workers)}

    def rpc(self, method: str, arg: str = "{}") -> list[Any]:
        out = self._http("POST", "/collective_rpc", {"method": method, "args": [arg]})
        return (out or {}).get("results", [])

    def _pause(self) -> None:
        if not self.paused:
            self._http("POST", f"/pause?mode={self.pause_mode}")
            self.paused = True

    def _resume(self) -> None:
        if self.paused:
            self._http("POST", "/resume")
            self.paused = False

    def begin(self, sync_id: str, version: int) -> None:
        self._pause()
        super().begin(sync_id, version)

    def _after_finalize(self) -> None:
        for _ in range(50):  # refused while blocks are held by requests kept across the pause
            if self._http("POST", "/reset_prefix_cache?reset_running_requests=true").get("success"):
                break
            time.sleep(0.1)
        else:
            raise make_error(ErrorCode.ENGINE_FAILED, "the server refused to reset its prefix cache")
        self._resume()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._resume()

    def probe(self, probes: list[Probe] | tuple[Probe, ...]) -> tuple[tuple[int, ...], ...]:
        out = []
        for p in probes:
            r = self._http("POST", "/v1/completions", {
                "model": self.served_model, "prompt": list(p.prompt), "max_tokens": p.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            out.append(tuple(r["choices"][0]["token_ids"]))
        return tuple(out)
