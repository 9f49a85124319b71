#!/usr/bin/env bash
# Everything the GPU path needs measured, in one device call on nvidia-h200-x2: the GPU tests
# (the TP=2 ones use both GPUs), then the benchmarks, one GPU each and side by side: the model
# throughput on GPU 0, the loss kernel and the SDPO iteration on GPU 1. Logs go to $OUT.
# Wheels in .whl/: megatron-core 0.19.2, transformers 5.24.0 + tokenizers 0.23.3, pydantic 2.14.4
# (+ pydantic-core, annotated-types, typing-inspection, typing-extensions).
# STEPS selects phases among "tests model loss iter" (default all); ITER_ARGS adds sdpo_iteration flags.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests model loss iter}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/env.log"
python3 -c "import torch, megatron.core, transformers; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), megatron.core.__version__, transformers.__version__, torch.cuda.device_count())" 2>&1 | tee -a "$OUT/env.log"
if [[ $STEPS == *tests* ]]; then
  timeout 260 python3 -m pytest tests/gpu -v -s -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^(default|gpu path|tp1|tp2) "
fi
if [[ $STEPS == *model* ]]; then
  (CUDA_VISIBLE_DEVICES=0 timeout 250 python3 benchmarks/gpu/model_throughput.py --shapes 0.6b 1.7b \
    > "$OUT/model_throughput.log" 2>&1) &
fi
( if [[ $STEPS == *loss* ]]; then
    CUDA_VISIBLE_DEVICES=1 timeout 100 python3 benchmarks/gpu/loss_kernel.py > "$OUT/loss_kernel.log" 2>&1; fi
  if [[ $STEPS == *iter* ]]; then
    CUDA_VISIBLE_DEVICES=1 timeout 200 python3 benchmarks/gpu/sdpo_iteration.py $ITER_ARGS > "$OUT/sdpo_iteration.log" 2>&1; fi ) &
wait
for f in loss_kernel model_throughput sdpo_iteration; do
  [[ -f "$OUT/$f.log" ]] || continue
  echo "== $f"; grep -E "^RESULT|Error|error:" "$OUT/$f.log" | grep -v "bench\": \"environment" | tail -14
done
grep -h "environment" "$OUT"/*.log 2>/dev/null | head -1
