#!/usr/bin/env bash
# Runs the whole test suite in a fresh virtual environment (.venv), installing everything it needs.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-venv.sh
python -m pytest -q -p no:cacheprovider "$@"
