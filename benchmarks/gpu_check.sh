#!/usr/bin/env bash
# The first GPU's check of the SPSA engine (benchmarks/gpu_check.py): CUDA update == CPU update, update time at
# paper-small and paper-n256 packed, eval throughput N=256 vs N=8, peak GPU memory, TF32 vs FP32; one table.
# Then soma serve's throughput on the GPU, N=256 vs N=8, against the in-process API (benchmarks/bench_serve.py).
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
smoke=0
for arg in "$@"; do [[ "$arg" == --smoke ]] && smoke=1; done
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
rc=0
timeout --signal=INT --kill-after=10 "$limit" "$py" benchmarks/gpu_check.py "$@" || rc=$?
[[ "$rc" == 2 ]] && exit 2  # no CUDA device here (it said so), or bad arguments: nothing more to run
# Then the served ensemble on the GPU (benchmarks/bench_serve.py, --device cuda): N = 256 against N = 8 through
# Ray Serve and in process, bounded to SERVE_CHECK_LIMIT_S (240); left out in smoke mode, with SERVE_CHECK=0, or
# where ray[serve] is not installed (pip install -e '.[serve]').
if [[ "$smoke" == 0 && "${SERVE_CHECK:-1}" != 0 ]]; then
  if "$py" -c "import ray.serve.handle" 2>/dev/null; then
    timeout --signal=INT --kill-after=10 "${SERVE_CHECK_LIMIT_S:-240}" "$py" benchmarks/bench_serve.py \
      --device cuda --repeats 1 --windows 512 --batch-windows 512 --concurrency 1,16,64 || rc=$((rc ? rc : $?))
  else
    echo "gpu_check: ray[serve] is not installed; the serving check is left out" >&2
  fi
fi
exit "$rc"
