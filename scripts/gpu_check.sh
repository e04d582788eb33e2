#!/usr/bin/env bash
# The prepared GPU check (dflash2_tools/gpu_check.py): correctness on the device, then step costs at fixed acceptance.
#   here, before the trip:  bash scripts/gpu_check.sh --fetch-wheels   # the tested transformers, trimmed to the models the
#                           check builds (~2.5 MB), into wheels/ (ignored by git: carry it); the GPU machine has no network
#   on the GPU machine:     bash scripts/gpu_check.sh                  # results in ${OUT:-gpu-check}/ (JSON + PNG), ~8 min at most
#   the CPU smoke test:     bash scripts/gpu_check.sh --device cpu --tiny
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ "${1:-}" = "--fetch-wheels" ]; then
  exec "$PY" -m dflash2_tools.gpu_check --write-wheel wheels
fi
# the tested transformers (5.23.x) when the machine has another one and the wheel was brought along
if ! "$PY" -c "import sys, transformers; sys.exit(0 if transformers.__version__.startswith('5.23.') else 1)"; then
  "$PY" -m pip install -q --no-deps wheels/transformers-5.23*.whl
fi
export HF_HUB_OFFLINE=1
exec timeout "${LIMIT_S:-480}" "$PY" -m dflash2_tools.gpu_check --out "${OUT:-gpu-check}" "$@"
