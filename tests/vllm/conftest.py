"""Real vLLM fixtures (CPU). Every test in this directory is marked `vllm`."""

from __future__ import annotations

import contextlib

import pytest

from orchestrator.daemon.config import set_process_env, vllm_process_env

# vLLM reads these at import: this process and the isolated scripts it starts (which
# inherit its environment) host in-process engines, V1 multiprocessing off.
set_process_env(vllm_process_env(False))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """One in-process vLLM (V1 multiprocessing off) hosting the tiny Llama."""
    pytest.importorskip("vllm")
    from engines.vllm.engine import VllmEngine

    engine = VllmEngine(tiny_model_dir, multiprocessing=False)
    yield engine
    engine.close()


def run_isolated(script: str, *args: str, timeout: int = 300, env: dict[str, str] | None = None) -> dict:
    """Run `script` in a fresh Python process and return the JSON it prints after RESULT.

    vLLM keeps torch.distributed state per process; a second in-process LLM (another
    model, or one torn down) would break the session's engine, so such tests go here.
    """
    import json
    import subprocess
    import sys

    from orchestrator.daemon.config import child_env

    r = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise AssertionError(f"isolated script failed (rc={r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


@contextlib.contextmanager
def vllm_server(model_dir, log_path, extra=()):
    """A vLLM OpenAI server for `model_dir` on a free local port, started with the
    documented command (`weightsync vllm-server`, docs/MULTINODE.md); yields its base URL."""
    with vllm_server_process(model_dir, log_path, extra) as (url, _):
        yield url


@contextlib.contextmanager
def vllm_server_process(model_dir, log_path, extra=()):
    """`vllm_server`, yielding (base URL, its Popen) for a test that kills the server."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from orchestrator.daemon.config import child_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    args += ["--max-model-len", "256", "--seed", "0", *extra]
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "vllm-server", str(model_dir), *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited:\n{log_path.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=10).close()
                break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError(f"vLLM server not up in 300s:\n{log_path.read_text()[-4000:]}")
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def server_cluster(workdir, model_dir, url):
    """A daemon and one `--backend vllm-server` engine (`server-0`) attached to `url`;
    logs shown on failure."""
    from examples.launch import Cluster

    c = Cluster(
        workdir,
        model_dir,
        engines=0,
        min_engines=1,
        backend="vllm-server",
        daemon_args=["--engine-timeout", "30"],
    )
    try:
        c.start_daemon()
        c.start_engine("server-0", ["--url", url, "--pause-mode", "keep"])
        c.wait_engines(1, timeout=120)
        yield c
    except BaseException:
        for p in c.procs:
            print(f"----- {p.name} -----\n{p.log_tail(60)}")
        raise
    finally:
        c.stop()


@contextlib.contextmanager
def vllm_fleet(workdir, model_dir, engines: dict[str, list[str]], daemon_args=(), engine_args=(), env=None):
    """A daemon and one `--backend vllm` engine per entry of `engines` (name -> its extra
    arguments), all registered before it yields; every log shown on failure. `env`: more
    environment for the processes (vLLM reads its CPU binding there)."""
    from examples.launch import Cluster

    c = Cluster(
        workdir,
        model_dir,
        engines=0,
        min_engines=len(engines),
        backend="vllm",
        daemon_args=["--engine-timeout", "30", *daemon_args],
        engine_args=list(engine_args),
        **({"env": env} if env else {}),
    )
    try:
        c.start_daemon()
        for name, args in engines.items():
            c.start_engine(name, args)
        c.wait_engines(len(engines), timeout=300)
        yield c
    except BaseException:
        for p in c.procs:
            print(f"----- {p.name} -----\n{p.log_tail(80)}")
        raise
    finally:
        c.stop()
