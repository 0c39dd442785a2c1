"""`.ci/files.py` (`make test`): every file alone, two at a time, in a random order inside each
file, never a silent green."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_files(tmp_path: Path, files: dict[str, str], *opts: str) -> subprocess.CompletedProcess[str]:
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    args = [*opts, *(str(tmp_path / n) for n in files)]
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / ".ci" / "files.py"),
            "--jobs",
            "2",
            *args,
            "--",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )


def test_a_failing_file_and_an_empty_one_fail_the_run_and_are_listed(tmp_path):
    r = run_files(
        tmp_path,
        {
            "test_ok.py": "def test_ok():\n    print('OK-LINE')\n",
            "test_bad.py": "def test_bad():\n    assert 1 == 2, 'BAD-LINE'\n",
            "test_empty.py": "X = 1\n",  # pytest exits 5: no tests collected
        },
    )
    assert r.returncode == 1, r.stdout + r.stderr
    failed = [ln.split()[1] for ln in r.stderr.splitlines() if ln.startswith("files:   ")]
    assert sorted(Path(f).name for f in failed) == ["test_bad.py", "test_empty.py"]
    assert "(exit 5)" in r.stderr and "(exit 1)" in r.stderr
    assert "files: 3 files, 2 failed" in r.stdout


def test_each_files_output_is_printed_whole_under_its_own_header(tmp_path):
    # both files print while running at the same time: each block must stay in one piece
    body = (
        "def test_{n}():\n    for i in range(200):\n        print('{n}-LINE', i, flush=True)\n    assert 0\n"
    )
    r = run_files(tmp_path, {"test_a.py": body.format(n="A"), "test_b.py": body.format(n="B")})
    assert r.returncode == 1
    blocks = r.stdout.split("\n== ")
    for name, mark, other in (("test_a.py", "A-LINE", "B-LINE"), ("test_b.py", "B-LINE", "A-LINE")):
        (block,) = [b for b in blocks if name in b.splitlines()[0]]
        assert all(f"{mark} {i}\n" in block for i in range(200)) and other not in block


def test_all_passing_files_exit_0(tmp_path):
    r = run_files(
        tmp_path, {"test_one.py": "def test_one():\n    pass\n", "test_two.py": "def test_two():\n    pass\n"}
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "files: 2 files, 0 failed" in r.stdout


# twelve tests that append their own name to ORDER as they run
ORDERED = "".join(f"def test_{i}():\n    open('ORDER', 'a').write('{i} ')\n" for i in range(12))


def run_order(tmp_path: Path, seed: int) -> tuple[str, list[str]]:
    order = tmp_path / "ORDER"
    order.unlink(missing_ok=True)
    r = run_files(tmp_path, {"test_order.py": ORDERED}, "--seed", str(seed))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, order.read_text().split()


def test_tests_inside_a_file_run_in_the_order_its_printed_seed_gives(tmp_path):
    out1, first = run_order(tmp_path, 1)
    out2, second = run_order(tmp_path, 2)
    again_out, again = run_order(tmp_path, 1)
    assert "seed 1 (replay: --seed 1)" in out1 and "seed 2" in out2
    assert sorted(first, key=int) == [str(i) for i in range(12)]
    assert first != second  # shuffled: two seeds give two orders (1 in 12! to collide)
    assert again == first  # and a printed seed replays its order
    assert first != sorted(first, key=int) or second != sorted(second, key=int)
