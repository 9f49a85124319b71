#!/usr/bin/env bash
# Start SGLang servers (and optionally an sglang-router) for a policy checkpoint.
#
#   infra/sglang/launch.sh --model-path /cache/<digest> [--servers 2] [--tp 1] [--mem-fraction 0.85] \
#       [--host 0.0.0.0] [--base-port 30000] [--router-port 29000] [--gpus 0,1,2,3] [--test-server] [--dry-run]
#
# Server i uses GPUs [i*tp, (i+1)*tp) of --gpus (default: 0..servers*tp-1) and listens on base-port+i.
# --router-port also starts the sglang-router (round robin) in front of all servers.
# --test-server starts the CPU stand-in (tests/sglang_server/app.py) instead of SGLang, no GPUs.
# Every server runs with the settings the rollout client relies on (see docs/sglang.md):
#   SGLANG_RETURN_ORIGINAL_LOGPROB=1   log-probs of the raw distribution (temperature 1), not the tempered one
#   --sampling-backend pytorch         per-request sampling_seed also with top_p < 1
#   --weight-version                   the client's version string for the initial checkpoint (optional)
# Extra server flags go after `--`, e.g. `-- --dtype bfloat16 --enable-deterministic-inference`.
# The script stays in the foreground; Ctrl-C (or SIGTERM) stops every process it started.
set -euo pipefail

model_path=""; servers=1; tp=1; mem_fraction=0.85; host="0.0.0.0"; base_port=30000
router_port=""; gpus=""; weight_version=""; log_dir="${SGLANG_LOG_DIR:-./sglang-logs}"; dry_run=0; test_server=0
python="${PYTHON:-python}"; extra=()

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model-path) model_path="$2"; shift 2 ;;
    --servers) servers="$2"; shift 2 ;;
    --tp) tp="$2"; shift 2 ;;
    --mem-fraction) mem_fraction="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --base-port) base_port="$2"; shift 2 ;;
    --router-port) router_port="$2"; shift 2 ;;
    --gpus) gpus="$2"; shift 2 ;;
    --weight-version) weight_version="$2"; shift 2 ;;
    --log-dir) log_dir="$2"; shift 2 ;;
    --test-server) test_server=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
done

[[ -n "$model_path" ]] || { echo "--model-path is required" >&2; usage 2; }
[[ "$dry_run" == 1 || -f "$model_path/config.json" ]] || { echo "$model_path has no config.json" >&2; exit 2; }
if [[ -z "$gpus" ]]; then gpus=$(seq -s, 0 $((servers * tp - 1))); fi
IFS=, read -r -a gpu_list <<< "$gpus"
if [[ "$test_server" == 0 ]] && (( ${#gpu_list[@]} < servers * tp )); then
  echo "need $((servers * tp)) GPUs for $servers servers x tp $tp, got --gpus $gpus" >&2; exit 2
fi
# the address clients use: a wildcard bind address is reached through this host's name
client_host="$host"; [[ "$host" == "0.0.0.0" ]] && client_host="$(hostname -f 2>/dev/null || hostname)"

pids=()
stop_all() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait || true; }
trap stop_all EXIT INT TERM

run() {  # run NAME CMD...: print it; start it in the background unless --dry-run
  local name="$1"; shift
  echo "+ $*"
  if [[ "$dry_run" == 0 ]]; then
    mkdir -p "$log_dir"
    "$@" > "$log_dir/$name.log" 2>&1 &
    pids+=("$!")
  fi
}

urls=()
for ((i = 0; i < servers; i++)); do
  port=$((base_port + i))
  if [[ "$test_server" == 1 ]]; then  # run from the repository root (the module lives in tests/)
    cmd=("$python" -m tests.sglang_server.app --model-path "$model_path" --host "$host" --port "$port")
  else
    devices=$(IFS=,; echo "${gpu_list[*]:$((i * tp)):$tp}")
    cmd=(env CUDA_VISIBLE_DEVICES="$devices" SGLANG_RETURN_ORIGINAL_LOGPROB=1
         "$python" -m sglang.launch_server
         --model-path "$model_path" --tp-size "$tp" --mem-fraction-static "$mem_fraction"
         --host "$host" --port "$port" --sampling-backend pytorch)
  fi
  [[ -n "$weight_version" ]] && cmd+=(--weight-version "$weight_version")
  run "server-$i" "${cmd[@]}" "${extra[@]}"
  urls+=("http://$client_host:$port")
done

router_url=""; [[ -n "$router_port" ]] && router_url="http://$client_host:$router_port"
router_cmd=("$python" -m sglang_router.launch_router --worker-urls "${urls[@]}"
            --host "$host" --port "$router_port" --policy round_robin --log-level warn)

wait_healthy() {  # wait_healthy URL...: until each answers /health 200, failing when a process exits
  for url in "$@"; do
    until curl -sf "$url/health" > /dev/null; do
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a process exited; see $log_dir" >&2; exit 1; }; done
      sleep 2
    done
    echo "healthy: $url"
  done
}

if [[ "$dry_run" == 1 ]]; then
  [[ -n "$router_url" ]] && run router "${router_cmd[@]}"
else
  echo "waiting for /health on ${urls[*]} (logs in $log_dir) ..."
  wait_healthy "${urls[@]}"
  if [[ -n "$router_url" ]]; then
    # started after the servers: the router registers workers in the background and answers
    # /health before it has any, so wait until its /workers lists every server as healthy
    run router "${router_cmd[@]}"
    wait_healthy "$router_url"
    until (( $(curl -sf "$router_url/workers" | grep -o '"is_healthy":true' | wc -l) >= servers )); do sleep 1; done
    echo "router $router_url routes to all $servers servers"
  fi
fi

echo
echo "rollout config (YAML):"
echo "  rollout:"
echo "    engine: sglang"
echo "    sglang:"
echo "      urls: [$(printf '"%s", ' "${urls[@]}" | sed 's/, $//')]"
if [[ -n "$router_url" ]]; then echo "      router_url: \"$router_url\""; fi
[[ "$dry_run" == 1 ]] && { trap - EXIT; exit 0; }
echo "all up; Ctrl-C stops them"
wait
