#!/usr/bin/env bash
# The GPU checks, in one prepared run (< 5 minutes on one GPU): NCCL through the collective
# group (needs 2+ GPUs: NCCL refuses two ranks on one device), CUDA IPC between two
# processes on one GPU, and the collective benchmark's figures. Prints GB/s.
# Usage: bash bench/gpu_check.sh   (from the repository root, after `make .venv/.test`)
set -euo pipefail
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 240 "$PY" -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider
