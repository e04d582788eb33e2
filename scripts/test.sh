#!/usr/bin/env bash
# Set up, then run the test suite (CPU, no network beyond PyPI, nothing from a model hub).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest tests "$@"
