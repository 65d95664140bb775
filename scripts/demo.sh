#!/usr/bin/env bash
# The main job end to end: creates .venv, installs datapipe (with DALI), makes a small real dataset
# (ImageNet-like JPEGs + token shards from real text), streams it through the loaders, prints throughput
# (one unit per column) and what to try next. Each install step prints a line; a rerun with setup.cfg and
# constraints.txt unchanged skips the install checks (scripts/setup-venv.sh).
# Usage: scripts/demo.sh [datapipe demo options, e.g. --images 5000]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-venv.sh
echo "demo: making the demo's data (first run only) and timing each loader" >&2
python -m datapipe demo "$@"
