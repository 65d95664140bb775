#!/usr/bin/env bash
# Runs on the GPU machine (device tool), after the staged DALI wheels were copied to /root/stage
# (../shared/device/stage-gpu-wheels.sh). Each argument is a part; results and logs go to $OUT.
#   bash bench/gpu_suite.sh tests images            # first call (installs the wheels)
#   bash bench/gpu_suite.sh loader doctor scaling   # next call, same warm machine
# Other parts: ceiling anatomy prefetch stalls workershm packing read next.
# How ImageLoader batches are awaited (its ready= option: event, the default; host; checked), interleaved
# (NEXT_ARGS: --steps 60 at most, one epoch of the 20k images):
#   NEXT_ARGS="--loaders images --variants default,hostready,checkedready --rounds 2 --steps 60" bash bench/gpu_suite.sh next
#   CEILING_ARGS="--steps 80 --burn-in 40 --only imageloader,imageloader_checkedready,imageloader_hostready,imageloader2,imageloader2_checkedready,imageloader2_hostready,imageloader3,imageloader3_checkedready,imageloader3_hostready" bash bench/gpu_suite.sh ceiling
# Deciding an ImageLoader default (pool the rows with bench/row_stats.py --against imageloader; each run
# gives three rows per variant in ~140 s):
#   CEILING_ARGS="--steps 80 --budget-s 430 --only imageloader,il_auto,imageloader_pace08,imageloader2,il_autob,imageloader2_pace08,imageloader3,il_autoc,imageloader3_pace08" bash bench/gpu_suite.sh ceiling
# Recycled worker memory in a training loop (A/B: fresh = recycling off, copied = not registered for CUDA,
# pin_memory = torch idiom with our loader; no DALI wheels needed for prefetch and workershm):
#   PREFETCH_ARGS="--steps 300 --repeats 3 --sizes-mb 64 --iters 3 --ours default,copied,pin_memory,fresh" bash bench/gpu_suite.sh prefetch
#   WORKERSHM_ARGS="--rounds 3 --spin-ms 0,40" bash bench/gpu_suite.sh workershm
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-suite}
DATA=${DATA:-/tmp/datapipe-bench-images}
mkdir -p "$OUT"
bash /root/stage/install.sh || exit 1
export PYTHONPATH=/root/site:$PWD
log="$OUT/suite.log"
step() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python -c "import torch, torchvision, nvidia.dali as d, webdataset; print('torch', torch.__version__, 'dali', d.__version__, 'cpus', __import__('os').cpu_count())" 2>&1 | tee -a "$log"
for part in "$@"; do
  case $part in
  tests)
    step gpu tests
    timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/datapipe/device tests/loaders/test_dataloader.py \
      tests/loaders/test_dataloader_compat.py tests/loaders/images/test_loader.py tests/loaders/images/test_outputs.py tests/loaders/test_tokens.py \
      tests/datapipe/tools/bench/test_cli.py tests/datapipe/tools/doctor/test_report.py tests/bench/test_wait_mode.py tests/bench/test_prefetch.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -25 | tee -a "$log" ;;
  images)
    step images benchmark
    timeout 420 python bench/images.py --data "$DATA" --out "$OUT" ${IMAGES_ARGS:-} 2>&1 | tail -60 | tee -a "$log" ;;
  loader)
    step bench loader: images
    timeout 240 python -m datapipe bench loader "$DATA" --device cuda --batch-size 256 --steps 30 --warmup 5 \
      --no-progress --json "$OUT/loader.json" 2>&1 | tail -30 | tee -a "$log"
    step bench loader: tokens
    timeout 120 python -c "from bench.scaling import ensure_tokens; ensure_tokens('/tmp/datapipe-scaling-tokens', 20000, 0)" 2>&1 | tail -3
    timeout 120 python -m datapipe bench loader /tmp/datapipe-scaling-tokens --device cuda --steps 100 --warmup 5 \
      --no-progress --json "$OUT/loader_tokens.json" 2>&1 | tail -20 | tee -a "$log" ;;
  doctor)
    step doctor
    timeout 240 python -m datapipe doctor --json "$OUT/doctor.json" --probe-capacity --ceiling-steps 15 -- bench/doctor_train.py "$DATA" 60 \
      2>&1 | tail -30 | tee -a "$log" ;;
  scaling)
    step scaling, 1 GPU
    timeout 240 torchrun --nproc_per_node=1 bench/scaling.py --images-dir "$DATA" --out "$OUT/scaling.json" ${SCALING_ARGS:-} \
      2>&1 | tail -12 | tee -a "$log" ;;
  scaling2)
    step scaling, 1 and 2 GPUs
    for n in 1 2; do
      NCCL_DEBUG=INFO timeout 280 torchrun --nproc_per_node=$n bench/scaling.py --images-dir "$DATA" \
        --out "$OUT/scaling.json" ${SCALING_ARGS:-} > "$OUT/scaling_${n}gpu.log" 2>&1
      echo "torchrun exit status $?" >> "$OUT/scaling_${n}gpu.log"
      grep -v "NCCL INFO" "$OUT/scaling_${n}gpu.log" | tail -8 | tee -a "$log"
    done ;;
  ceiling)  # the decode_device="cpu" run: CEILING_ARGS="--steps 50 --ceiling-steps 30 --warmup 6 --only imageloader,il_cpu,dali_hand,il_cpu_u8,standalone,dl_ours,dl_torch,profile,tokens,tokens_llama"
    step ceiling: training at its data-free ceiling
    timeout ${CEILING_TIMEOUT:-480} ${CEILING_PREFIX:-} python bench/ceiling.py --data "$DATA" --out "$OUT" ${CEILING_ARGS:-} 2>&1 | grep -v "^    {" \
      | tail -40 | tee -a "$log" ;;
  anatomy)
    step step anatomy: where the step time goes with each feed
    timeout ${ANATOMY_TIMEOUT:-300} python bench/step_anatomy.py --data "$DATA" --out "$OUT" ${ANATOMY_ARGS:-} 2>&1 \
      | tail -30 | tee -a "$log" ;;
  elastic2)
    step elastic resume: ImageLoader + ResNet-50 on 2 GPUs, SIGKILL, resume on 1 GPU, then on 2
    timeout 300 python bench/elastic_gpu.py --out "$OUT" 2>&1 | tail -40 | tee -a "$log" ;;
  stalls)
    step launch stalls: which host activity blocks the training thread kernel launches
    timeout ${STALLS_TIMEOUT:-420} python bench/launch_stalls.py --out "$OUT" ${STALLS_ARGS:-} 2>&1 \
      | tail -20 | tee -a "$log" ;;
  workershm)
    step worker batches in recycled shared memory against torch
    timeout ${WORKERSHM_TIMEOUT:-240} python bench/worker_shm.py --device cuda --out "$OUT" ${WORKERSHM_ARGS:-} 2>&1 \
      | tail -14 | tee -a "$log" ;;
  prefetch)
    step prefetch benchmark
    timeout ${PREFETCH_TIMEOUT:-240} python bench/prefetch.py --device cuda --out "$OUT" ${PREFETCH_ARGS:-} 2>&1 \
      | tail -25 | tee -a "$log" ;;
  packing)
    step packing benchmark
    timeout 200 python bench/packing.py --device cuda --out "$OUT/packing.json" ${PACKING_ARGS:-} 2>&1 | tail -40 | tee -a "$log" ;;
  next)
    step next latency: where next takes its time with the batch ready
    timeout ${NEXT_TIMEOUT:-240} python bench/next_latency.py --out "$OUT" ${NEXT_ARGS:-} 2>&1 | tail -20 | tee -a "$log" ;;
  read)
    step read throughput
    timeout 120 python bench/read_throughput.py --out "$OUT" 2>&1 | tail -8 | tee -a "$log" ;;
  *) echo "unknown part: $part" | tee -a "$log"; exit 2 ;;
  esac
done
step done
