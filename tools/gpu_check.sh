#!/usr/bin/env bash
# offload's one command for a GPU machine (issue #30): build the extension offline, run the
# cuda-marked tests, the race probes (also under TORCH_CUDA_SANITIZER), and measure
# practicality and model TFLOP/s; a table last, JSON and a log under $OUT when set.
#   tools/gpu_check.sh             on the GPU machine (at most ~8 minutes)
#   tools/gpu_check.sh --dry-run   the same phases on the CPU at tiny sizes
# Options: python3 tools/gpu_check.py --help.  PYTHON picks the interpreter (default python3,
# or the project's .venv when there is one).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" tools/gpu_check.py "$@"
