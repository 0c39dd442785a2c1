"""weightsync selected through vLLM's own trainer API (`orchestrator.trainer.vllm_native`):
the trainer does only what vLLM's API asks (`WeightTransferTrainerFactory.trainer_init(
init_info, client=..., source=...)`, then `send_weights()` on every rank), and a real vLLM
OpenAI server started with `--weight-transfer-config '{"backend": "weightsync"}'` takes
what it sends, through its weightsync engine, with the version label committed."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightTransferTrainerFactory,
)

from engines.torch_engine import greedy, load_model
from messages.buckets import digest
from messages.errors import ErrorCode, WeightSyncError
from orchestrator.trainer.vllm_native import (
    WeightSyncTrainerEngine,
    WeightSyncTrainerInitInfo,
)
from tests.integration.helpers import running_daemon
from tests.vllm.conftest import server_cluster, vllm_server

PROMPTS = [(1, 17, 42, 99, 7), (1, 250, 3, 64)]


class RecordingClient(HTTPVLLMWeightSyncClient):  # type: ignore[misc]
    """vLLM's HTTP client to the server, recording every call the trainer engine makes."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init_weight_transfer_engine")
        return super().init_weight_transfer_engine(init_info)

    def start_weight_update(self):
        self.calls.append("start_weight_update")
        return super().start_weight_update()

    def update_weights(self, update_info):
        self.calls.append("update_weights")
        return super().update_weights(update_info)

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish_weight_update")
        return super().finish_weight_update(weight_version)


class PartSource(WeightSource):  # type: ignore[misc]
    """A source whose rank holds `held` of `model`'s parameters (vLLM's held_names contract:
    metadata is the whole model's; iteration yields None for a name not held)."""

    def __init__(self, model: torch.nn.Module, held: set[str] | None, on_item=None) -> None:
        self.model, self.held, self.on_item = model, held, on_item

    def metadata(self):
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def held_names(self):
        return self.held

    def __iter__(self):
        for i, (n, p) in enumerate(self.model.named_parameters()):
            if self.on_item is not None:
                self.on_item(i)
            yield n, (p.detach() if self.held is None or n in self.held else None)


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _step(model: torch.nn.Module, v: int) -> None:
    """A training step's worth of change: every parameter moves, as a function of `v`."""
    g = torch.Generator().manual_seed(1000 + v)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)


def _digest(model: torch.nn.Module) -> str:
    return digest([(n, p.detach()) for n, p in model.named_parameters()])


def _served(server: str, prompt) -> tuple[int, ...]:
    served = _get(server + "/v1/models")["data"][0]["id"]
    body = {
        "model": served,
        "prompt": list(prompt),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return tuple(_post(server + "/v1/completions", body)["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    log = Path(tmp_path_factory.mktemp("vllm-native-server")) / "server.log"
    with vllm_server(tiny_model_dir, log) as url:
        yield url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir, server):
    with server_cluster(Path(tmp_path_factory.mktemp("vllm-native-cluster")), tiny_model_dir, server) as c:
        yield c


def test_three_send_weights_through_vllms_trainer_factory_commit_on_the_server(
    cluster, server, tiny_model_dir
):
    model = load_model(tiny_model_dir)
    client = RecordingClient(server)
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(addr=cluster.addr, rank=0, transport="collective", bucket_bytes=256 * 1024),
        client=client,
        source=ModuleSource(model),
    )
    assert isinstance(engine, WeightSyncTrainerEngine)
    try:
        start = engine.version or 0
        for step in range(1, 4):
            _step(model, start + step)
            engine.send_weights()
            v = start + step
            assert engine.version == v and engine.last is not None and engine.last.state == "READY"
            assert engine.last.detail["transport"] == "collective"
            st = cluster.status()
            (e,) = st["engines"]
            assert (st["state"], st["version"]) == ("READY", v)
            assert (e["state"], e["version"], e["digest"]) == ("READY", v, _digest(model))
            assert engine.last.digest == _digest(model)
            # the server labels what it generates with the committed version
            assert _get(server + "/weight_info")["weight_version"] == str(v)
            assert e["label"] == str(v)
        for p in PROMPTS:  # and generates from the weights the trainer holds
            assert _served(server, p) == greedy(model, p, 6)
        # vLLM's worker drives its own start/update/finish (the server's weightsync
        # engine does): the trainer engine never called the framework's client
        assert client.calls == []
    finally:
        engine.shutdown()


def test_two_trainer_ranks_holding_disjoint_names_push_one_sharded_version(cluster, server, tiny_model_dir):
    model = load_model(tiny_model_dir)
    names = [n for n, _ in model.named_parameters()]
    parts = [set(names[0::2]), set(names[1::2])]
    engines = [
        WeightTransferTrainerFactory.trainer_init(
            WeightSyncTrainerInitInfo(addr=cluster.addr, rank=k, world_size=2, bucket_bytes=128 * 1024),
            client=None,
            source=PartSource(model, parts[k]),
        )
        for k in range(2)
    ]
    try:
        assert [e.owned for e in engines] == [frozenset(p) for p in parts]
        v = (engines[0].version or 0) + 1
        _step(model, v)
        errors: list[BaseException] = []

        def rank(k: int) -> None:
            try:
                engines[k].send_weights()
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert [e.version for e in engines] == [v, v]
        assert {e.last.digest for e in engines} == {_digest(model)}
        assert engines[0].last.sync_id == engines[1].last.sync_id  # one sync, two sources
        st = cluster.status()
        assert st["version"] == v and st["engines"][0]["digest"] == _digest(model)
        assert _get(server + "/weight_info")["weight_version"] == str(v)
        assert _served(server, PROMPTS[0]) == greedy(model, PROMPTS[0], 6)
    finally:
        for e in engines:
            e.shutdown()


def test_an_engine_killed_during_send_weights_raises_in_time_and_the_next_commits(tmp_path, tiny_model_dir):
    """Two torch engines, `--min-engines 1`: one SIGKILLed while send_weights streams. It
    raises within the engine deadline + 10 s naming it, the survivor is rolled back to the
    version it served, and the next send_weights commits on it."""
    args = ["--engine-timeout", "5", "--spool", str(tmp_path / "spool")]
    with running_daemon(tmp_path, tiny_model_dir, engines=2, min_engines=1, daemon_args=args) as c:
        model = load_model(tiny_model_dir)
        victim = next(p for p in c.procs if p.name == "engine-1")
        armed = threading.Event()

        def on_item(i: int) -> None:
            if armed.is_set() and i == 4:
                victim.popen.send_signal(signal.SIGKILL)
                victim.popen.wait(30)

        engine = WeightTransferTrainerFactory.trainer_init(
            WeightSyncTrainerInitInfo(addr=c.addr, rank=0, bucket_bytes=64 * 1024, window=1),
            client=None,
            source=PartSource(model, None, on_item),
        )
        try:
            _step(model, 1)
            engine.send_weights()
            served = (engine.version, _digest(model))
            _step(model, 2)
            armed.set()
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as ei:
                engine.send_weights()
            assert time.monotonic() - t0 < 5 + 10
            assert ei.value.code is ErrorCode.ENGINE_FAILED and "engine-1" in ei.value.message
            assert engine.version == served[0]  # nothing new committed
            armed.clear()

            def rolled_back():
                st = c.status()
                e0 = next(e for e in st["engines"] if e["engine_id"] == "engine-0")
                return st["state"] == "READY" and (e0["state"], e0["version"], e0["digest"]) == (
                    "READY",
                    *served,
                )

            deadline = time.monotonic() + 60
            while not rolled_back():
                assert time.monotonic() < deadline, c.status()
                time.sleep(0.1)
            _step(model, 3)
            engine.send_weights()
            st = c.status()
            engines = {e["engine_id"]: e for e in st["engines"]}
            assert (st["state"], st["version"]) == ("READY", engine.version)
            assert engines["engine-0"]["digest"] == _digest(model) and engines["engine-1"]["state"] == "LOST"
        finally:
            engine.shutdown()
