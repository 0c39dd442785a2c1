"""Run every test file alone, each in its own pytest process, `--jobs` of them at a time.

Usage: python .ci/files.py [--jobs N] [--seed S] [FILE...] [-- PYTEST_ARGS...]   (from the repository root)

Rules:
- Each file runs alone in a fresh `python -m pytest -q FILE`: a file that passes only after
  another has run fails here. Inside a file the tests run in a random order
  (pytest-randomly), one seed for the whole run, printed first (`--seed S` replays it: the
  same order in every file). Which files run beside each other does not
  matter to that check, so the order is free: the files run in their sorted order, except
  that the real-vLLM files (tests/vllm/) run one at a time and go first when none is running
  (one lane carries them while the others take the rest; two CPU vLLMs on two cores would
  only race their own timeouts).
- A file's output is buffered and printed whole when it ends (never interleaved), headed by
  `== FILE (N s, exit RC)`.
- Any non-zero pytest exit is a failure, 5 (no tests collected) included; so is finding no
  files. The run ends with the list of failed files and exits 1: never a silent green.
- tests/verl runs in its own environment (`make test-verl`), not here.
"""

# ruff: noqa: T201  (a CI script: its printed report is its output)

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HEAVY = "tests/vllm/"
# each file's output ends with its tests that took 5 s or more (setup, call and teardown apart)
SLOW = ["--durations=0", "--durations-min=5"]


def find_files(root: Path) -> list[str]:
    files = sorted(str(p.relative_to(root)) for p in root.glob("tests/**/test_*.py"))
    return [f for f in files if not f.startswith("tests/verl/")]


class Queue:
    """The files left to run; hands out at most one HEAVY file at a time, HEAVY first."""

    def __init__(self, files: list[str]) -> None:
        self.left = list(files)
        self.heavy_running = False
        self.cond = threading.Condition()

    def take(self) -> str | None:
        with self.cond:
            while True:
                if not self.left:
                    return None
                if not self.heavy_running:
                    pick = next((f for f in self.left if f.startswith(HEAVY)), self.left[0])
                else:
                    pick = next((f for f in self.left if not f.startswith(HEAVY)), None)
                if pick is not None:
                    self.left.remove(pick)
                    if pick.startswith(HEAVY):
                        self.heavy_running = True
                    return pick
                self.cond.wait()  # only HEAVY files left and one is running

    def done(self, f: str) -> None:
        with self.cond:
            if f.startswith(HEAVY):
                self.heavy_running = False
            self.cond.notify_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="test files run at the same time")
    ap.add_argument("--seed", type=int, default=None, help="pytest-randomly's seed (default: a new one)")
    ap.add_argument("files", nargs="*", help="test files (default: every tests/**/test_*.py but tests/verl)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: given to every pytest
    files = args.files or find_files(Path.cwd())
    if not files:
        print("files: no test files found", file=sys.stderr)
        return 1
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"files: random order inside each file, seed {seed} (replay: --seed {seed})")
    sys.stdout.flush()
    queue = Queue(files)
    print_lock = threading.Lock()
    results: dict[str, tuple[int, float]] = {}
    start = time.monotonic()

    def lane() -> None:
        while (f := queue.take()) is not None:
            t0 = time.monotonic()
            rc, text = 1, ""
            try:
                with tempfile.TemporaryFile() as out:
                    cmd = [sys.executable, "-m", "pytest", "-q", f"--randomly-seed={seed}", *SLOW, *extra, f]
                    rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
                    out.seek(0)
                    text = out.read().decode(errors="replace")
            except OSError as e:  # could not start it: a failure of that file, and the run goes on
                text = f"files: could not run {f}: {e}\n"
            finally:
                queue.done(f)
            took = time.monotonic() - t0
            with print_lock:
                results[f] = (rc, took)
                print(f"== {f} ({took:.0f} s, exit {rc})\n{text}", end="" if text.endswith("\n") else "\n")
                sys.stdout.flush()

    lanes = [threading.Thread(target=lane, name=f"lane-{i}") for i in range(max(1, args.jobs))]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()

    failed = [f for f in files if results.get(f, (1, 0.0))[0] != 0]
    busy = sum(took for _, took in results.values())
    print(
        f"files: {len(files)} files, {len(failed)} failed, {time.monotonic() - start:.0f} s "
        f"({busy:.0f} s of file time in {len(lanes)} lanes)"
    )
    slowest = sorted(results.items(), key=lambda kv: -kv[1][1])[:15]
    print("files: slowest: " + ", ".join(f"{f} {took:.0f} s" for f, (_, took) in slowest))
    if failed:
        print("files: FAILED (each alone):", file=sys.stderr)
        for f in failed:
            rc, _ = results.get(f, (None, 0.0))
            print(f"files:   {f} (exit {rc})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
