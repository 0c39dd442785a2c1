"""What a new operator hits, round two (failure records, output, the vLLM server command):
each case through a real daemon, real torch engines and the real CLI.

3 failures filed under their real code and author, epoch times, which way an engine was
lost; 7 output: one-line usage errors, help text, no colours in files, a library that
stays off stdout, demo logs kept, Ctrl-C said, the state after the client's own abort,
canary probes from the command line (a daemon that cannot bind leaves nothing behind:
tests/integration/test_cli.py).
(6, the vLLM server command, runs in tests/vllm/test_vllm_server.py.)
"""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from engines.torch_engine import load_model
from examples.tiny import perturbed
from messages.buckets import iter_buckets
from messages.canary import make_probes
from messages.errors import DataError, ErrorCode

from .helpers import running_daemon, sigint_default, ws

pytestmark = pytest.mark.slow

ANSI = re.compile(r"\x1b\[")


def settle(cluster, timeout=30.0):
    """Wait until no sync (nor rollback) runs; return the status."""
    deadline = time.monotonic() + timeout
    while True:
        st = cluster.status()
        if st["sync"] is None and not st["rollback_pending"]:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon did not settle: {st['state']} {st['sync']}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("op2")
    args = ["--engine-timeout", "3", "--spool", str(work / "spool"), "--metrics-bind", "127.0.0.1:0"]
    with running_daemon(work, tiny_model_dir, engines=1, daemon_args=args) as c:
        yield c


@pytest.fixture(scope="module")
def empty(tmp_path_factory):
    """A daemon with no engines (for waits that never end on their own)."""
    with running_daemon(tmp_path_factory.mktemp("op2-empty"), None, engines=0, min_engines=1) as c:
        yield c


def next_version(c) -> int:
    return (settle(c)["last_ready_version"] or 0) + 1


def journal_row(cluster, sync_id):
    db = sqlite3.connect(cluster.state_db)
    try:
        return db.execute(
            "SELECT status, code, reason, ended_by FROM syncs WHERE sync_id=?", (sync_id,)
        ).fetchone()
    finally:
        db.close()


def failures_metric(cluster, code) -> float:
    addr = cluster.status()["daemon"]["metrics_addr"]
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    m = re.search(rf'^weightsync_sync_failures_total\{{code="{code}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def push_ok(cluster, tiny_state):
    v = next_version(cluster)
    with cluster.client(timeout=30) as c:
        return c.push(list(perturbed(tiny_state, v)), v, bucket_bytes=64 << 10)


# -- 3: failures under their real code and author -------------------------------------------


def test_3_a_push_given_up_on_shape_mismatch_is_filed_as_shape_mismatch_by_the_trainer(cluster, tiny_state):
    push_ok(cluster, tiny_state)
    before = failures_metric(cluster, "SHAPE_MISMATCH")
    v = next_version(cluster)
    weights = dict(perturbed(tiny_state, v))
    weights["model.norm.weight"] = torch.zeros(7)  # the engines hold another shape
    with cluster.client(timeout=30) as c, pytest.raises(DataError) as ei:
        c.push(weights.items(), v, bucket_bytes=64 << 10)
    err = ei.value
    assert err.code is ErrorCode.SHAPE_MISMATCH
    # 7: the error says where the daemon is after the client's own abort, not before it
    assert err.state in ("IDLE", "READY"), err.state
    sid = err.sync_id
    settle(cluster)
    status, code, reason, by = journal_row(cluster, sid)
    assert (status, code, by) == ("ABORTED", "SHAPE_MISMATCH", "trainer"), (status, code, reason, by)
    assert "aborted by the trainer" in reason and "SHAPE_MISMATCH" in reason
    assert failures_metric(cluster, "SHAPE_MISMATCH") == before + 1


def test_3_an_operators_abort_is_filed_as_the_operators_with_its_reason(cluster, tiny_state):
    push_ok(cluster, tiny_state)
    v = next_version(cluster)
    with cluster.client(timeout=30) as holder:
        sid = holder.begin(v).sync_id
        r = ws("abort", "--reason", "bad checkpoint", "--addr", cluster.addr, "--json")
        assert r.returncode == 0, r.stderr
    last = settle(cluster)["last_sync"]
    assert last["sync_id"] == sid and last["by"] == "operator", last
    assert last["reason"] == "sync aborted by an operator: bad checkpoint", last
    assert journal_row(cluster, sid)[3] == "operator"


def test_3_a_rollback_names_the_failed_sync_with_epoch_times(cluster, tiny_state):
    push_ok(cluster, tiny_state)
    v = next_version(cluster)
    with cluster.client(timeout=30) as c:
        sid = c.begin(v).sync_id
        for b in iter_buckets(list(perturbed(tiny_state, v))[:2], 64 << 10):
            c.send_bucket(sid, b)  # engines hold new buckets: the abort leaves them dirty
        c.abort(sid, "test")
    st = settle(cluster)
    last = st["last_sync"]
    assert last["status"] == "ROLLED_BACK", last
    failed = last["rolled_back_from"]
    assert failed["sync_id"] == sid and failed["by"] == "trainer", failed
    now = time.time()
    assert abs(failed["at"] - now) < 300, (failed["at"], now)  # Unix seconds, not monotonic
    assert all(abs(h["at"] - now) < 3600 for h in st["history"]), st["history"]


# -- 7: output ------------------------------------------------------------------------------


def test_7_a_usage_error_is_one_plain_line_naming_the_command():
    r = ws("push", "--bogus")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: weightsync push: No such option: --bogus (see 'weightsync push --help')"
    ]
    r = ws("serve", "--min-engines", "two")
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "--min-engines" in line and "env var" not in line, line


def test_7_help_keeps_its_bracketed_text():
    r = ws("--help")
    assert r.returncode == 0 and "[serve], [push]" in " ".join(r.stdout.split()), r.stdout
    r = ws("push", "--help")
    assert "[default: sized from measured acks" in " ".join(r.stdout.split()), r.stdout
    assert "╭" not in r.stdout


def test_7_waiting_for_engines_writes_no_colours_into_a_file_and_the_library_stays_off_stdout(
    empty, tmp_path, tiny_state
):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(dict(list(perturbed(tiny_state, 1))[:2]), str(d / "model.safetensors"))
    with open(tmp_path / "err.log", "w") as err:
        r = subprocess.run(
            [sys.executable, "-m", "orchestrator", "push", str(d), "--version", "1", "--addr", empty.addr]
            + ["--engines-wait", "1.5"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=60,
        )
    text = (tmp_path / "err.log").read_text()
    assert r.returncode == 4 and "NO_ENGINES" in text and "waiting" in text, text
    assert not ANSI.search(text), text
    # A training script using the library: its stdout is its own.
    script = (
        "import sys\n"
        "from orchestrator.trainer import TrainerClient\n"
        "from messages.errors import WeightSyncError\n"
        "import torch\n"
        "with TrainerClient(sys.argv[1], timeout=10) as c:\n"
        "    try:\n"
        "        c.push([('w', torch.zeros(4))], 1, engines_wait=1.5)\n"
        "    except WeightSyncError as e:\n"
        "        print('SCRIPT', e.code.value)\n"
    )
    r = subprocess.run([sys.executable, "-c", script, empty.addr], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "SCRIPT NO_ENGINES", (r.stdout, r.stderr)
    assert "waiting" in r.stderr and not ANSI.search(r.stderr), r.stderr


def test_7_a_ctrl_c_during_a_push_says_so_and_exits_130(empty, tmp_path, tiny_state):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(dict(list(perturbed(tiny_state, 1))[:2]), str(d / "model.safetensors"))
    p = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "push", str(d), "--version", "1", "--addr", empty.addr]
        + ["--engines-wait", "60"],
        preexec_fn=sigint_default,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = p.stderr.readline()  # the push says it waits for engines: it is in its begin loop
    assert "waiting" in first, first
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, (out, err)
    assert "push interrupted: the sync of version 1 was aborted" in err, err
    assert "Traceback" not in err


def test_7_make_demo_keeps_the_logs_it_names():
    r = ws("demo", "--versions", "1", "--engines", "1", timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    m = re.search(r"logs kept in (\S+)", r.stdout)
    assert m, r.stdout[-2000:]
    logs = Path(m.group(1))
    try:
        assert logs.is_dir() and {"daemon.log", "engine-0.log"} <= {p.name for p in logs.iterdir()}
        assert "daemon_started" in (logs / "daemon.log").read_text()
        assert [p.name for p in logs.parent.iterdir()] == ["logs"]  # model and journal removed
    finally:
        import shutil

        shutil.rmtree(logs.parent, ignore_errors=True)


def _probes_file(tmp_path, tiny_model_dir, tiny_state, v, *, wrong=False) -> Path:
    model = load_model(tiny_model_dir)
    model.load_state_dict(dict(perturbed(tiny_state, v)))
    probes = make_probes(model, [[1, 17, 42, 99], [1, 250, 3]], 4)
    if wrong:
        p0 = probes[0]
        probes[0] = type(p0)(p0.prompt, p0.max_tokens, ((p0.expected[0] + 1) % 64, *p0.expected[1:]))
    path = tmp_path / ("wrong.json" if wrong else "probes.json")
    path.write_bytes(msgspec.json.encode(probes))
    return path


def test_7_push_checks_canary_probes_from_a_file(cluster, tmp_path, tiny_model_dir, tiny_state):
    v = next_version(cluster)
    d = tmp_path / f"ckpt-{v}"
    d.mkdir()
    save_file(dict(perturbed(tiny_state, v)), str(d / "model.safetensors"))
    good = _probes_file(tmp_path, tiny_model_dir, tiny_state, v)
    expected = [list(p["expected"]) for p in json.loads(good.read_text())]
    r = ws("push", str(d), "--version", str(v), "--addr", cluster.addr, "--probes", str(good))
    assert r.returncode == 0, r.stderr
    engines = settle(cluster)["last_sync"]["engines"]
    assert [e["probes"] for e in engines] == [expected]
    v += 1
    d2 = tmp_path / f"ckpt-{v}"
    d2.mkdir()
    save_file(dict(perturbed(tiny_state, v)), str(d2 / "model.safetensors"))
    wrong = _probes_file(tmp_path, tiny_model_dir, tiny_state, v, wrong=True)
    r = ws("push", str(d2), "--version", str(v), "--addr", cluster.addr, "--probes", str(wrong), "--json")
    assert r.returncode == 4 and json.loads(r.stdout)["code"] == "CANARY_MISMATCH", (r.stdout, r.stderr)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": []}]')
    r = ws("push", str(d2), "--version", str(v), "--addr", cluster.addr, "--probes", str(bad))
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "--probes" in line and "prompt" in line, line
