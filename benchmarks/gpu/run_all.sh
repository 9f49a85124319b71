#!/usr/bin/env bash
# Everything the GPU path needs measured, on nvidia-h200-x2: the benchmarks in two lanes side by
# side, one GPU each (GPU 0: step profile, 1.7B throughput; GPU 1: loss kernel, packed attention,
# 0.6B throughput, SDPO iteration), then the GPU tests (the TP=2 ones use both GPUs). Logs go to
# $OUT. All of it takes more than one 10-minute device call: run STEPS="model profile loss packed
# iter", then STEPS=tests alone (the GPU tests take about 8 minutes on one H200).
# Wheels in .whl/: megatron-core 0.19.2, transformers 5.24.0 + tokenizers 0.23.3, pydantic 2.14.4
# (+ pydantic-core, annotated-types, typing-inspection, typing-extensions).
# STEPS selects phases among "model profile loss packed iter tests" (default all);
# ITER_ARGS adds sdpo_iteration flags, MODEL_ARGS model_throughput flags.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
STEPS=${STEPS:-model profile loss packed iter tests}
MODEL_ARGS=${MODEL_ARGS:---fused false true}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/env.log"
python3 -c "import torch, megatron.core, transformers; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), megatron.core.__version__, transformers.__version__, torch.cuda.device_count())" 2>&1 | tee -a "$OUT/env.log"
has() { [[ " $STEPS " == *" $1 "* ]]; }
( export CUDA_VISIBLE_DEVICES=0
  if has profile; then timeout 300 python3 benchmarks/gpu/profile_step.py --shape 1.7b --profile > "$OUT/profile_step.log" 2>&1; fi
  if has model; then timeout 240 python3 benchmarks/gpu/model_throughput.py --shapes 1.7b $MODEL_ARGS > "$OUT/model_1.7b.log" 2>&1; fi ) &
( export CUDA_VISIBLE_DEVICES=1
  if has loss; then timeout 100 python3 benchmarks/gpu/loss_kernel.py > "$OUT/loss_kernel.log" 2>&1; fi
  if has packed; then timeout 150 python3 benchmarks/gpu/packed_attention.py > "$OUT/packed_attention.log" 2>&1; fi
  if has model; then timeout 200 python3 benchmarks/gpu/model_throughput.py --shapes 0.6b $MODEL_ARGS > "$OUT/model_0.6b.log" 2>&1; fi
  if has iter; then timeout 200 python3 benchmarks/gpu/sdpo_iteration.py $ITER_ARGS > "$OUT/sdpo_iteration.log" 2>&1; fi ) &
wait
if has tests; then
  # the pipeline-launched two-GPU tests take a device call each (run_pipeline.sh's test-dp2, test-tp2)
  timeout 560 python3 -m pytest tests/gpu -k "not trains_like_one_gpu" -v -s -p no:cacheprovider -o addopts="" 2>&1 \
    | tee "$OUT/gpu_tests.log" \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^(default|gpu path|tp1|tp2) "
fi
for f in loss_kernel packed_attention model_0.6b model_1.7b profile_step sdpo_iteration; do
  [[ -f "$OUT/$f.log" ]] || continue
  echo "== $f"; grep -E "^RESULT|Error|error:" "$OUT/$f.log" | grep -v "bench\": \"environment" | cut -c1-600 | tail -16
done
grep -h "environment" "$OUT"/*.log 2>/dev/null | head -1
