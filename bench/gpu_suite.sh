#!/usr/bin/env bash
# One run on the GPU machine (device tool): install the staged wheels (../shared/device/stage-gpu-wheels.sh),
# run the gpu-marked tests, then every benchmark; results and logs go to $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-suite}
mkdir -p "$OUT"
bash /root/stage/install.sh || exit 1
export PYTHONPATH=/root/site:$PWD
log="$OUT/suite.log"
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python -c "import torch, torchvision, nvidia.dali as d, webdataset; print('torch', torch.__version__, 'dali', d.__version__, 'cpus', __import__('os').cpu_count())" 2>&1 | tee -a "$log"
step gpu tests
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/datapipe/test_prefetch.py tests/loaders/test_dataloader.py \
  tests/loaders/test_images.py tests/loaders/test_tokens.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 | tee -a "$log"
step images benchmark
timeout 300 python bench/images.py --out "$OUT" ${IMAGES_ARGS:-} 2>&1 | tail -40 | tee -a "$log"
step prefetch benchmark
timeout 150 python bench/prefetch.py --device cuda --out "$OUT" 2>&1 | tail -25 | tee -a "$log"
step packing benchmark
timeout 200 python bench/packing.py --device cuda --out "$OUT/packing.json" ${PACKING_ARGS:-} 2>&1 | tail -40 | tee -a "$log"
step read throughput
timeout 120 python bench/read_throughput.py --out "$OUT" 2>&1 | tail -8 | tee -a "$log"
step done
