#!/usr/bin/env bash
# The main job end to end: creates .venv, installs datapipe (with DALI), makes a small real dataset
# (ImageNet-like JPEGs + token shards from real text), streams it through the loaders, prints throughput.
# Usage: scripts/demo.sh [datapipe demo options, e.g. --images 5000]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup-venv.sh
python -m datapipe demo "$@"
