#!/usr/bin/env bash
# The first GPU's check of the SPSA engine (benchmarks/gpu_check.py): CUDA update == CPU update, update time at
# paper-small and paper-n256 packed, eval throughput N=256 vs N=8, peak GPU memory, TF32 vs FP32; one table.
#   benchmarks/gpu_check.sh            on a CUDA machine, bounded to 8 minutes (GPU_CHECK_LIMIT_S)
#   benchmarks/gpu_check.sh --smoke    on the CPU at toy sizes, under a minute (tests/test_gpu_check.py)
# Python: $PYTHON, else the repository's .venv, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
limit="${GPU_CHECK_LIMIT_S:-480}"
for arg in "$@"; do [[ "$arg" == --smoke ]] && limit="${GPU_CHECK_LIMIT_S:-120}"; done
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec \
  timeout --signal=INT --kill-after=10 "$limit" "$py" benchmarks/gpu_check.py "$@"
