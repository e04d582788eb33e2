#!/usr/bin/env bash
# Main job: set up, then stream speculative generation with the embedded target and the shipped drafter.
#   bash scripts/demo.sh ["your prompt"] [more dflash2_tools.demo options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m dflash2_tools.demo "$@"
