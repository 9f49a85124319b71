#!/usr/bin/env bash
# The train stage's ranks on another node of a multi-node run, iteration after iteration.
#
#   infra/torchrun/node.sh --root s3://bucket/runs --run-name NAME --from 1 --to 100 \
#       --nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-endpoint node-a.cluster.internal:29500
#
# Node A runs the flow (`sdpo run` or a Prefect deployment) with launch.train.launcher: torchrun,
# nnodes 2, node_rank 0 and the same rdzv_endpoint; its train stage of iteration n waits at the
# rendezvous for this node's `sdpo stage train --iteration n`, started here under torchrun with the
# command tasks/launch.py's stage_command builds. A launch that fails (node A not at its train
# stage yet, so the rendezvous timed out; or a rank failed) is retried up to --retries times
# before the script gives up; a stage that is already committed returns at once.
# Set SDPO_STORAGE_OPTIONS (JSON fsspec options, e.g. '{"endpoint_url": "http://minio:9000"}') as on
# node A, and mount storage.cache_dir at the same path as node A: rank 0 assembles the
# checkpoint from every rank's shards there.
set -euo pipefail

root=""; run_name=""; first=1; last=""; nproc=1; nnodes=2; node_rank=1; endpoint=""; retries=30; wait_s=20
python="${PYTHON:-python}"
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --root) root="$2"; shift 2 ;;
    --run-name) run_name="$2"; shift 2 ;;
    --from) first="$2"; shift 2 ;;
    --to) last="$2"; shift 2 ;;
    --nproc-per-node) nproc="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --rdzv-endpoint) endpoint="$2"; shift 2 ;;
    --retries) retries="$2"; shift 2 ;;
    --retry-wait) wait_s="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done
[[ -n "$root" && -n "$run_name" && -n "$last" && -n "$endpoint" ]] || {
  echo "--root, --run-name, --to and --rdzv-endpoint are required" >&2; usage 2; }
(( node_rank >= 1 && node_rank < nnodes )) || { echo "--node-rank must be in [1, $nnodes): node 0 runs the flow" >&2; exit 2; }

host="${endpoint%:*}"; port="${endpoint##*:}"
for ((n = first; n <= last; n++)); do
  for ((try = 1; ; try++)); do
    cmd=("$python" -m torch.distributed.run --nproc_per_node="$nproc" --nnodes="$nnodes" --node_rank="$node_rank"
         --master_addr="$host" --master_port="$port"
         -m flows.cli stage train --root "$root" --run-name "$run_name" --iteration "$n")
    echo "+ ${cmd[*]}"
    if "${cmd[@]}"; then break; fi
    if (( try > retries )); then echo "train stage of iteration $n failed $try times; giving up" >&2; exit 1; fi
    echo "iteration $n: launch $try failed; retrying in ${wait_s}s" >&2
    sleep "$wait_s"
  done
done
