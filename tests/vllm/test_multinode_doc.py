"""docs/MULTINODE.md's worked example, run as the page writes it on the lab of hosts: the
daemon and the trainer on one host, a vLLM OpenAI server and the engine feeding it on each
of two others, every byte between hosts over a 200 Mbit/s link.

The commands are read from the page: the worked example's daemon and engine commands, the
`weightsync vllm-server` command of its "A vLLM OpenAI server as an engine" section (the
example's "a vLLM server on the same host"), and the example's trainer snippet. Replaced,
and only these: the addresses 10.0.0.1 (the daemon and trainer host), 10.0.0.2 and 10.0.0.3
(the engine hosts) by the lab's, `$(hostname)` by each host's name, the model paths by a
tiny random Llama, the spool's path by a fresh directory, `weightsync` by `python -m
orchestrator`; the trainer snippet gets a `model` (the tiny Llama), a `train_step()` that
moves every parameter, and `steps = 2`, which the page leaves to the reader."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.doc_commands import commands, section, substitute
from tests.lab.net import Host, Lab, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

STEPS = 2


def _program(argv: list[str]) -> list[str]:
    if argv[0] != "weightsync":
        raise AssertionError(f"a command the test does not know how to run: {argv}")
    return [sys.executable, "-m", "orchestrator", *argv[1:]]


def _wait(
    what: str, ok, procs: dict[str, subprocess.Popen[bytes]], logs: Path, timeout: float = 300.0
) -> None:
    """Until `ok()`; a process of the run that exits first fails the test with its log."""
    deadline = time.monotonic() + timeout
    while not ok():
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(
                    f"{name} exited {p.returncode}:\n{(logs / f'{name}.log').read_text()[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout}s")
        time.sleep(1.0)


def _answers(h: Host, url: str) -> bool:
    probe = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=5).close()"
    return h.run([sys.executable, "-c", probe], timeout=30).returncode == 0


def _status(h: Host, addr: str) -> dict:
    r = h.run([sys.executable, "-m", "orchestrator", "status", "--addr", addr, "--json"], timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def test_the_worked_example_runs_as_written_on_three_hosts(tmp_path, tiny_model_dir):
    example = section("MULTINODE.md", "Worked example")
    daemon_cmd, engine_cmd = commands(example.split("```python")[0])
    server_cmd = next(c for c in commands(example) if c[:2] == ["weightsync", "vllm-server"])
    (snippet,) = re.findall(r"```python\n(.*?)```", example, re.S)
    assert daemon_cmd[:2] == ["weightsync", "serve"] and engine_cmd[:2] == ["weightsync", "engine"]

    with Lab(rate_mbit=200) as lab:
        node1, node2, node3 = lab.host("node1"), lab.host("node2"), lab.host("node3")
        procs: dict[str, subprocess.Popen[bytes]] = {}
        common = {
            "10.0.0.1": node1.addr,
            "/models/policy": str(tiny_model_dir),
            "/models/llama": str(tiny_model_dir),
        }
        spool = tmp_path / "spool"
        argv = substitute(daemon_cmd, {**common, "/var/lib/weightsync/spool": str(spool)})
        # the page's command names no --state-db: its default is relative, so the daemon runs
        # in a directory of this test's own
        (tmp_path / "node1").mkdir()
        procs["daemon"] = node1.popen(_program(argv), log=tmp_path / "daemon.log", cwd=tmp_path / "node1")
        for h in (node2, node3):
            procs[f"server-{h.name}"] = h.popen(
                _program(substitute(server_cmd, common)), log=tmp_path / f"server-{h.name}.log"
            )
        for h in (node2, node3):
            _wait(
                f"{h.name}'s vLLM server",
                lambda h=h: _answers(h, "http://127.0.0.1:8000/v1/models"),
                procs,
                tmp_path,
            )
            mine = {**common, "10.0.0.2": h.addr, "$(hostname)": h.hostname}
            procs[f"engine-{h.name}"] = h.popen(
                _program(substitute(engine_cmd, mine)), log=tmp_path / f"engine-{h.name}.log"
            )
        addr = f"tcp://{node1.addr}:5555"

        def both_registered() -> bool:
            engines = _status(node1, addr).get("engines", [])
            return sorted(e["engine_id"] for e in engines if e["state"] != "LOST") == sorted(
                [node2.hostname, node3.hostname]
            )

        _wait("both engines registered", both_registered, procs, tmp_path)

        prelude = textwrap.dedent(
            f"""
            import torch
            from engines.torch_engine import load_model
            model = load_model({str(tiny_model_dir)!r})
            steps = {STEPS}
            _step = [0]
            def train_step():
                _step[0] += 1
                g = torch.Generator().manual_seed(_step[0])
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.02)
            """
        )
        trainer = (
            prelude
            + substitute_text(snippet, common)
            + (
                "\nimport json\nfrom messages.buckets import digest\n"
                "print('DIGEST', digest(model.state_dict().items()), result.version, flush=True)\n"
                "print('GROUP', json.dumps(client.status()['collective']), flush=True)\n"
            )
        )
        run = node1.run([sys.executable, "-c", trainer], timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.splitlines()
        assert [ln.split()[0] for ln in lines if ln.startswith("collective")] == ["collective"] * STEPS, lines
        _, want, version = next(ln for ln in lines if ln.startswith("DIGEST")).split()
        st = _status(node1, addr)
        assert (st["state"], st["version"]) == ("READY", int(version)) and int(version) == STEPS, st
        served = {e["engine_id"]: (e["state"], e["version"], e["digest"]) for e in st["engines"]}
        assert served == {h.hostname: ("READY", STEPS, want) for h in (node2, node3)}, served
        # while the trainer is connected, status shows the group: the trainer and one rank
        # per engine (the group goes with the trainer's connection, which hosts its store)
        group = json.loads(next(ln for ln in lines if ln.startswith("GROUP")).split(" ", 1)[1])
        assert group is not None and group["world_size"] == 3, (group, lines)


def substitute_text(text: str, values: dict[str, str]) -> str:
    """The snippet's text with each address or path in `values` replaced (whole tokens)."""
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, values)) + r")(?![\w.])")
    return pattern.sub(lambda m: values[m.group(1)], text)
