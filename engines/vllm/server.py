"""`--backend vllm-server`: attach to a vLLM OpenAI server already running on this host.

The server must be started with `--worker-extension-cls
engines.vllm_extension.WeightSyncExtension` and `VLLM_SERVER_DEV_MODE=1` (that exposes
`/collective_rpc`, `/reset_prefix_cache`, `/pause`, `/resume`). Buckets travel through
shared memory exactly as for the in-process engine; only descriptors (JSON strings) go
over HTTP. Generation is paused from `begin` until finalize is done, with the configured
mode for in-flight requests (keep: frozen and resumed; wait: drained first; abort).
Probes run after `resume` (a paused server cannot generate), so between resume and the
orchestrator's READY the server already answers with the new, finalized weights.

vLLM's own weight-transfer API: a server started with `--weight-transfer-config
'{"backend": "weightsync"}'` (engines.vllm_transfer) takes syncs by a group through its
routes instead: `/start_weight_update`, one `/update_weights` per bucket (each worker
receives the bucket by broadcast), `/finish_weight_update`. Which path a sync takes is
decided by its first bucket (by a group or not), so begin is deferred until then; frames,
references, rollback and catch-up buckets keep the extension's path.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog

from engines.base import EngineOptions
from engines.vllm.base import Parts, VllmBase
from messages.errors import ErrorCode, make_error
from messages.schema import Probe, Ref, TensorMeta

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from engines.vllm.extension import NativeInfo, WorkerInfo
    from messages.replies import Json, JsonObject

log = structlog.get_logger()

PAUSE_MODES = ("keep", "wait", "abort")
HEALTH_TIMEOUT = 5.0  # seconds a health probe waits for the server (vLLM's GET /health)


class VllmServerEngine(VllmBase):
    backend = "vllm-server"

    def __init__(
        self,
        model_dir: str | Path,
        url: str,
        *,
        pause_mode: str = "keep",
        timeout: float = 600.0,
        staging_bytes: int = 64 << 20,
        bind: str = "",
    ) -> None:
        self.bind = bind  # this host's address for the group's sockets
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.url = url.rstrip("/")
        self.pause_mode = pause_mode
        self.timeout = timeout
        models = self._http("GET", "/v1/models")
        self.served_model = models["data"][0]["id"]
        try:
            self.workers = cast("list[WorkerInfo]", self.rpc("ws_info"))
        except RuntimeError as exc:
            raise RuntimeError(
                f"{self.url} does not run the weightsync extension ({exc}); start it with "
                "--worker-extension-cls engines.vllm_extension.WeightSyncExtension and "
                "VLLM_SERVER_DEV_MODE=1"
            ) from None
        self._setup(model_dir, staging_bytes)
        self.finalize_count = min(w["finalize_count"] for w in self.workers)
        self.paused = False
        self.native = self._init_native()
        self._native_finalizes = 0
        self._pending: tuple[str, int] | None = None  # begin deferred to the first bucket
        self._mode: str | None = None  # "native" | "extension" for the running sync
        log.info(
            "vllm_server_attached",
            url=self.url,
            model=self.served_model,
            workers=len(self.workers),
            pause_mode=pause_mode,
        )

    def _http(self, method: str, path: str, body: object = None) -> Any:
        """The route's JSON answer (None when empty), as `json.loads` gives it: each caller
        reads the shape its route answers with."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"{method} {path}: HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise make_error(ErrorCode.ENGINE_FAILED, f"{self.url} unreachable: {exc.reason}") from None
        return json.loads(raw) if raw else None

    def health(self) -> str | None:
        """vLLM's `GET /health` within HEALTH_TIMEOUT: None when it answers 200, else why
        not (refused, timed out, an HTTP error). Runs on the worker's health thread."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=HEALTH_TIMEOUT) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            return f"{self.url}/health: HTTP {exc.code}"
        except urllib.error.URLError as exc:
            return f"{self.url} unreachable: {exc.reason}"
        except (OSError, ValueError) as exc:  # a timeout reading, a reset connection
            return f"{self.url}/health: {type(exc).__name__}: {exc}"
        return None

    def _extra(self) -> JsonObject:
        return {
            "url": self.url,
            "served_model": self.served_model,
            "pause_mode": self.pause_mode,
            "workers": len(self.workers),
            "native_weight_transfer": self.native,
        }

    def _workers(self) -> int:
        return len(self.workers)

    def _init_native(self) -> bool:
        """True when the server runs vLLM's weight-transfer engine with our backend."""
        infos = self._native_infos()
        if not infos or not all(i.get("native") for i in infos):
            return False
        self._http("POST", "/init_weight_transfer_engine", {"init_info": {"bind": self.bind}})
        return True

    # -- a sync: begin deferred until the first bucket says which path it takes ---------
    def begin(self, sync_id: str, version: int) -> None:
        self._pause()
        self.sync_id, self._digest, self._mode = sync_id, None, None
        self._pending = (sync_id, version)

    def _start(self, mode: str) -> None:
        if self._pending is None:
            return
        sync_id, version = self._pending
        self._pending = None
        self._mode = mode
        if mode == "native":
            self._http("POST", "/start_weight_update", {})
        else:
            super().begin(sync_id, version)

    def load_bucket(self, metas: Sequence[TensorMeta], buf: Buffer, parts: Parts = None) -> None:
        self._start("extension")
        super().load_bucket(metas, buf, parts)

    def load_ref(
        self, metas: Sequence[TensorMeta], ref: Ref, bucket_checksum: int, parts: Parts = None
    ) -> None:
        self._start("extension")
        super().load_ref(metas, ref, bucket_checksum, parts)

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
        if not self.native:
            self._start("extension")
            super().load_group(metas, group, size, bucket_checksum, bind, seq, next_bucket, mac)
            return
        self._check(metas)
        self._start("native")
        update_info: dict[str, object] = {  # engines.vllm.transfer.WeightSyncUpdateInfo
            "sync_id": self.sync_id,
            "group": group,
            "size": size,
            "checksum": bucket_checksum,
            "tensors": [m.to_wire() for m in metas],
            "seq": seq or 0,
            "mac": list(mac) if mac is not None else None,
        }
        self._http("POST", "/update_weights", {"update_info": update_info})

    def finalize(self, sync_id: str) -> str:
        self._start("extension")  # a sync with no bucket (all-partial) still finalizes once
        if self._mode != "native":
            digest = super().finalize(sync_id)
            self.finalize_count += self._native_finalizes  # the worker counts only its own path
            return digest
        self._http("POST", "/finish_weight_update", {})
        infos = self._native_infos()
        digests = {i["digest"] for i in infos}
        agreed = next(iter(digests)) if len(digests) == 1 else None
        if agreed is None:
            raise make_error(ErrorCode.ENGINE_FAILED, f"vLLM workers disagree on the digest: {digests}")
        self._after_finalize()
        self._native_finalizes = min(i["finalize_count"] for i in infos)
        self.finalize_count += 1
        self._digest = agreed
        return agreed

    def close_group(self) -> None:
        if not self.native:
            super().close_group()

    def rpc(self, method: str, arg: str = "{}") -> list[Json]:
        out = self._http("POST", "/collective_rpc", {"method": method, "args": [arg]})
        return list((out or {}).get("results", []))

    def _native_infos(self) -> list[NativeInfo]:
        """Every worker's `ws_native_info` (engines.vllm.extension)."""
        return cast("list[NativeInfo]", self.rpc("ws_native_info"))

    def _pause(self) -> None:
        if not self.paused:
            self._http("POST", f"/pause?mode={self.pause_mode}")
            self.paused = True

    def _resume(self) -> None:
        if self.paused:
            self._http("POST", "/resume")
            self.paused = False

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
            if self._mode == "native":  # vLLM has no abort: finish leaves update mode (mixed weights)
                self._http("POST", "/finish_weight_update", {})
                self._digest = None
            elif self._mode == "extension":
                super().abort()
            self._pending, self._mode = None, None
        finally:
            self._resume()

    def set_label(self, label: str) -> str:
        """The server's weight version (vLLM's RL routes): its outputs carry it from now on;
        returns what the server reports back."""
        self._http("POST", "/update_weight_version", {"new_version": label})
        info = self._http("GET", "/weight_info")
        return str((info or {}).get("weight_version", ""))

    def probe(self, probes: Sequence[Probe]) -> tuple[tuple[int, ...], ...]:
        out = []
        for p in probes:
            r = self._http(
                "POST",
                "/v1/completions",
                {
                    "model": self.served_model,
                    "prompt": list(p.prompt),
                    "max_tokens": p.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            out.append(tuple(r["choices"][0]["token_ids"]))
        return tuple(out)


def make_engine(options: EngineOptions) -> VllmServerEngine:
    url = options.get("url")
    if not url:
        raise ValueError("--backend vllm-server needs --url http://HOST:PORT")
    return VllmServerEngine(
        options["model"],
        url,
        pause_mode=options.get("pause_mode") or "keep",
        bind=options.get("collective_host") or "",
    )
