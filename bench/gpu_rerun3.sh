#!/usr/bin/env bash
# Fourth GPU-machine run: gpu tests, and the image benchmark with reader worker processes.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-rerun3}
mkdir -p "$OUT"
bash /root/stage/install.sh || exit 1
export PYTHONPATH=/root/site:$PWD
log="$OUT/suite.log"
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step gpu tests
timeout 100 python -m pytest -q -m gpu -p no:cacheprovider tests/datapipe/test_prefetch.py tests/loaders/test_dataloader.py \
  tests/loaders/test_images.py tests/loaders/test_tokens.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 | tee -a "$log"
step images benchmark
timeout 300 python bench/images.py --out "$OUT" --only a,c,d,d_workers,train --train-loaders d_workers,d --steps 200 2>&1 \
  | grep -v "img/s\]" | tail -30 | tee -a "$log"
step done
