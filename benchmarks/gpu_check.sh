#!/usr/bin/env bash
# The GPU check: one run, under 8 minutes on one GPU, results in one JSON file (default
# benchmarks/results/gpu_check.json), then the gpu-marked tests. See benchmarks/gpu_check.py for the steps.
# Usage: bash benchmarks/gpu_check.sh [OUT.json] [WORK]; render into docs/benchmarks.md afterwards with
#   python benchmarks/gpu_check.py --out OUT.json --write
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu_check.json}"
work="${2:-$(mktemp -d)}"
python - <<'PY' || { echo "error: the GPU check needs a CUDA device; none is visible to torch" >&2; exit 1; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py --work "$work" --out "$out"
python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
echo "results: $out"
