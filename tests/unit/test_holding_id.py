"""A holding engine's default id is the same for a holder restarted in the same place (a
new process), so the daemon keeps one record of it instead of one per restart."""

from __future__ import annotations

import socket
import subprocess
import sys

from orchestrator.daemon.config import child_env

SCRIPT = """
import sys
from engines.holding import HoldingReceiver
kw = {"rank": int(sys.argv[3])} if len(sys.argv) > 3 else {}
r = HoldingReceiver(sys.argv[1], sys.argv[2], **kw)
print("ENGINE_ID", r.engine_id, flush=True)
r.close()
"""


def default_id(model_dir, connect, *rank: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), connect, *rank],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=True,
    )
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("ENGINE_ID ")]
    return line.split()[1]


def test_the_default_holder_id_survives_a_restart_and_names_host_and_rank(tmp_path, tiny_model_dir):
    connect = f"ipc://{tmp_path}/nobody.sock"  # no daemon: the id is chosen before it registers
    first, again = default_id(tiny_model_dir, connect), default_id(tiny_model_dir, connect)
    assert first == again == f"{socket.gethostname()}-holding-0"
    assert default_id(tiny_model_dir, connect, "3") == f"{socket.gethostname()}-holding-3"
