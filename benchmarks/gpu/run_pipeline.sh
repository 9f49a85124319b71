#!/usr/bin/env bash
# The pipeline on one GPU (nvidia-h200): the pipeline GPU test, then `sdpo run` of
# benchmarks/gpu/pipeline.yaml and the same work in TRL's SDPOTrainer, per shape. Logs go to $OUT.
# Wheels in .whl/ (docs/benchmarks.md lists them): megatron-core, transformers, pydantic, Prefect,
# mlflow-skinny, TRL, datasets and what they need that the image lacks.
# STEPS picks among "test test-dp2 test-tp2 pipe-0.6b trl-0.6b pipe-1.7b trl-1.7b pipe-1.7b-dp2
# pipe-1.7b-tp2 mfu train-tests kernel-tests decode profile" (default: test pipe-0.6b trl-0.6b; profile: where the
# decode step, the draw and the teacher scoring spend their time, benchmarks/gpu/iteration_profile.py; decode: the captured-decode GPU
# tests and benchmarks/gpu/decode_bench.py on both shapes, captured and eager; train-tests: the training and
# scorer GPU tests, tests/gpu/test_gpu_train.py; test-dp2 / test-tp2: on two GPUs, the pipeline-launched
# DP=2 / TP=2 test of tests/gpu/test_gpu_pipeline.py, each beside the one-GPU run it compares with).
# pipe-1.7b-dp2: the 1.7B pipeline with its train stage on two GPUs under the pipeline's torchrun
# launcher (data parallel); pipe-1.7b-tp2: the same tensor parallel, the Megatron teacher stage on the
# same two ranks. Their RESULT lines carry tokens/s and MFU per GPU; pipe-1.7b on the same machine is
# the one-GPU baseline of the scaling efficiency.
# PIPE_ITERS / TRL_ITERS set the iterations of each run (default 3 / 2), PIPE_OVERRIDES more dotted
# overrides for the pipeline runs (e.g. train.megatron_checkpoint_every=5), PIPE_TIMEOUT / TRL_TIMEOUT
# the seconds each may take (default 300 / 300); a pipeline run cut short is stopped with its
# whole process group and read back for the iterations it committed. Each step's run folder under
# /tmp is removed once its figures are in the log, so steps of one call (and calls on a machine kept
# warm) do not fill the device's disk.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
STEPS=${STEPS:-test pipe-0.6b trl-0.6b}
PIPE_ITERS=${PIPE_ITERS:-3}; TRL_ITERS=${TRL_ITERS:-2}; PIPE_TIMEOUT=${PIPE_TIMEOUT:-300}; TRL_TIMEOUT=${TRL_TIMEOUT:-300}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONWARNINGS=ignore TRL_EXPERIMENTAL_SILENCE=1 \
  DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, megatron.core, transformers, prefect, mlflow, trl; print(torch.__version__, torch.version.cuda, megatron.core.__version__, transformers.__version__, prefect.__version__, mlflow.__version__, trl.__version__)"
  python3 -c "import torch; print('NCCL', '.'.join(map(str, torch.cuda.nccl.version())), 'GPUs', torch.cuda.device_count())"
  env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM|CUDA_DEVICE_MAX)" | sort   # the collective settings every rank inherits
} 2>&1 | tee "$OUT/env.log"
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has test; then
  timeout 180 python3 -m pytest tests/gpu/test_gpu_pipeline.py -k "not two_gpus" -v -p no:cacheprovider -o addopts="" \
    > "$OUT/gpu_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -8
fi
for layout in dp2 tp2; do
  has "test-$layout" || continue
  timeout 560 python3 -m pytest tests/gpu/test_gpu_pipeline.py -k "two_gpus and $layout" -v -s -p no:cacheprovider \
    -o addopts="" > "$OUT/gpu_tests_$layout.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^$layout " "$OUT/gpu_tests_$layout.log" | tail -8
done
for shape in 0.6b 1.7b; do
  # TRL first: the pipeline run is stopped as a process group, but nothing may hold the GPU before TRL
  if has "trl-$shape"; then
    timeout -k 5 $TRL_TIMEOUT python3 -m benchmarks.gpu.trl_sdpo --shape $shape --out /tmp/trl-$shape --iterations $TRL_ITERS \
      > "$OUT/trl_$shape.log" 2>&1
    rm -rf /tmp/trl-$shape
  fi
  if has "pipe-$shape"; then
    python3 -m benchmarks.gpu.pipeline_run --shape $shape --out /tmp/pipe-$shape --iterations $PIPE_ITERS \
      --timeout $PIPE_TIMEOUT $PIPE_OVERRIDES > "$OUT/pipeline_$shape.log" 2>&1
    # read back already (RESULT lines in the log): the next step needs the disk (64 GiB on the device;
    # a 1.7B run's store and cache hold ~50 GB after two iterations with the final Megatron state)
    rm -rf /tmp/pipe-$shape
  fi
done
for layout in dp2 tp2; do
  has "pipe-1.7b-$layout" || continue
  if [[ $layout == dp2 ]]; then
    spread=(launch.train.launcher=torchrun launch.train.nproc_per_node=2)
  else
    spread=(train.tensor_parallel=2 launch.train.launcher=torchrun launch.train.nproc_per_node=2
            launch.teacher.launcher=torchrun launch.teacher.nproc_per_node=2)
  fi
  python3 -m benchmarks.gpu.pipeline_run --shape 1.7b --out /tmp/pipe-1.7b-$layout --iterations $PIPE_ITERS \
    --timeout $PIPE_TIMEOUT "${spread[@]}" > "$OUT/pipeline_1.7b_$layout.log" 2>&1
  rm -rf /tmp/pipe-1.7b-$layout
done
if has mfu; then
  timeout 200 python3 benchmarks/gpu/model_throughput.py --shapes 1.7b --fused true > "$OUT/model_1.7b.log" 2>&1
fi
if has decode; then
  timeout 240 python3 -m pytest tests/gpu/test_gpu_decode.py -v -p no:cacheprovider -o addopts="" > "$OUT/gpu_decode_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_decode_tests.log" | tail -8
  timeout 300 python3 -m benchmarks.gpu.decode_bench --shapes 0.6b 1.7b --loops static eager --repeat 1 > "$OUT/decode.log" 2>&1
fi
if has profile; then
  timeout 300 python3 -m benchmarks.gpu.iteration_profile --shape 0.6b > "$OUT/profile.log" 2>&1
fi
if has kernel-tests; then  # the draw, RMSNorm and scoring kernels, and the pipelined hand-over
  timeout 300 python3 -m pytest tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_handover.py -v -p no:cacheprovider \
    -o addopts="" > "$OUT/gpu_kernel_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_kernel_tests.log" | tail -14
fi
if has train-tests; then
  timeout 240 python3 -m pytest tests/gpu/test_gpu_train.py -v -p no:cacheprovider -o addopts="" > "$OUT/gpu_train_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_train_tests.log" | tail -8
fi
for f in "$OUT"/pipeline_*.log "$OUT"/trl_*.log "$OUT"/model_*.log "$OUT"/decode.log "$OUT"/profile.log; do
  [[ -f "$f" ]] || continue
  echo "== $f"; grep -E "^RESULT|Error|error:" "$f" | cut -c1-900 | tail -8
done
