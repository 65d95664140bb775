#!/usr/bin/env bash
# A shorter GPU-machine run after fixes: gpu tests, the image and prefetch benchmarks, preprocessing scaling.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-rerun}
mkdir -p "$OUT"
bash /root/stage/install.sh || exit 1
export PYTHONPATH=/root/site:$PWD
log="$OUT/suite.log"
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step gpu tests
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/datapipe/test_prefetch.py tests/loaders/test_dataloader.py \
  tests/loaders/test_images.py tests/loaders/test_tokens.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 | tee -a "$log"
step images benchmark
timeout 240 python bench/images.py --out "$OUT" --only d,d_dali,c,train --train-loaders a,d,d_dali --steps 200 2>&1 | grep -v "img/s\]" | tail -30 | tee -a "$log"
step prefetch benchmark
timeout 100 python bench/prefetch.py --device cuda --out "$OUT" 2>&1 | tail -12 | tee -a "$log"
step preprocess scaling
timeout 100 python bench/preprocess.py --workers 1,2,4,8,16 --out "$OUT" 2>&1 | tail -15 | tee -a "$log"
step done
