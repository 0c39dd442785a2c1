"""The layers hold (import-linter contracts over every import, function-level included),
and breaking one is caught: an upward import or a cycle written into a copy of the tree
fails `lint-imports` naming the contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("messages", "orchestrator", "engines", "bench", "examples")
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(
    not LINT.exists(), reason="import-linter is not installed (make lint installs it)"
)


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120)


def copy_tree(tmp: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def test_the_repository_keeps_every_layer_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_an_upward_import_inside_a_function_is_caught(tmp_path):
    root = copy_tree(tmp_path)
    table = root / "orchestrator" / "core" / "table.py"
    table.write_text(
        table.read_text()
        + "\n\ndef _peek():\n    from orchestrator.daemon import service\n\n    return service\n"
    )
    r = lint(root)
    assert r.returncode == 1
    assert "the core imports only messages BROKEN" in r.stdout


def test_a_trainer_importing_the_daemon_is_caught(tmp_path):
    root = copy_tree(tmp_path)
    client = root / "orchestrator" / "trainer" / "client.py"
    client.write_text(client.read_text() + "\nfrom orchestrator.daemon.config import Settings  # noqa\n")
    r = lint(root)
    assert r.returncode == 1
    assert "a trainer imports only messages: it never pulls in the daemon BROKEN" in r.stdout


def test_an_import_cycle_is_caught(tmp_path):
    root = copy_tree(tmp_path)
    schema = root / "messages" / "schema.py"  # codec imports schema; now schema imports codec
    schema.write_text(
        schema.read_text() + "\n\ndef _codec():\n    from messages import codec\n\n    return codec\n"
    )
    r = lint(root)
    assert r.returncode == 1
    assert "no import cycle between modules of a package" in r.stdout and "BROKEN" in r.stdout
