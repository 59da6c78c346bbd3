#!/usr/bin/env bash
# Multi-node launch of examples/grpo_math_qwen32b.yaml: the trainer under torchrun on the first
# TRAIN_NODES nodes, vLLM servers for the rollouts on the others. Run it on every node (by hand,
# pdsh, or an srun wrapper that sets NODE_RANK); --help prints the variables.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: NNODES=8 TRAIN_NODES=4 NODE_RANK=<rank> MASTER_ADDR=<host of node 0> \
       ROLLOUT_HOSTS="<host> ..." bash scripts/launch_grpo_math_qwen32b.sh [--set key=value ...]

Run on every node, from a checkout of llmrl on a file system all nodes share (the run folder must
be visible to every training process). Nodes 0 .. TRAIN_NODES-1 train: one torchrun over them,
GPUS_PER_NODE processes each, FSDP2. Nodes TRAIN_NODES .. NNODES-1 generate: SERVERS_PER_NODE vLLM
servers each, TP GPUs per server, started with the flags llmrl checks for (processed logprobs,
llmrl's worker extension, the weight-transfer backend of TRANSPORT, VLLM_SERVER_DEV_MODE=1). The
training nodes wait until every server answers /health, then start torchrun with the servers'
URLs as inference.base_url. Arguments after the variables go to `llmrl train` (e.g. --set
run_dir=/shared/runs/qwen32b). Stop a node with Ctrl-C or SIGTERM: a rollout node stops its servers.

Required:
  NNODES          nodes in all (8)
  TRAIN_NODES     nodes that train (4); the rest serve rollouts
  NODE_RANK       this node's rank, 0 .. NNODES-1
  MASTER_ADDR     address of node 0 (torchrun's rendezvous)
  ROLLOUT_HOSTS   addresses of the rollout nodes, space-separated, in node-rank order
                  (NNODES - TRAIN_NODES of them; the training nodes connect to them)

Optional (default):
  MASTER_PORT             torchrun's port (29500)
  GPUS_PER_NODE           GPUs per node (8)
  SERVERS_PER_NODE        vLLM servers per rollout node (2)
  TP                      tensor-parallel GPUs per server (GPUS_PER_NODE / SERVERS_PER_NODE)
  VLLM_PORT               port of a node's first server; the next ones count up (8000)
  MODEL                   model the servers load; must be the config's model.spec (Qwen/Qwen2.5-32B)
  CONFIG                  the run config (examples/grpo_math_qwen32b.yaml)
  TRANSPORT               weight sync: nccl | http | disk (nccl; disk needs WEIGHTS_DIR)
  WEIGHTS_DIR             folder every node sees, for TRANSPORT=disk
  MAX_MODEL_LEN           longest prompt + completion the servers accept (16384)
  GPU_MEMORY_UTILIZATION  share of each GPU a server takes (0.9)
  SEED                    the servers' seed; requests carry their own (0)
  PYTHON                  the trainer's Python, with llmrl (.venv/bin/python)
  VLLM_PYTHON             the servers' Python, with vLLM and llmrl (.venv-vllm/bin/python)
  SERVER_WAIT_S           how long training nodes wait for the servers (1800)
  LOG_DIR                 where rollout nodes write server logs (logs/grpo_math_qwen32b)
  DRY_RUN                 1: print the commands instead of running them
EOF
}

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  usage
  exit 0
fi

fail() {
  echo "error: $*" >&2
  echo "(bash scripts/launch_grpo_math_qwen32b.sh --help for usage)" >&2
  exit 2
}

missing=()
for name in NNODES TRAIN_NODES NODE_RANK MASTER_ADDR ROLLOUT_HOSTS; do
  [[ -n "${!name:-}" ]] || missing+=("$name")
done
if ((${#missing[@]})); then
  usage >&2
  echo >&2
  fail "missing variables: ${missing[*]}"
fi

MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SERVERS_PER_NODE=${SERVERS_PER_NODE:-2}
VLLM_PORT=${VLLM_PORT:-8000}
MODEL=${MODEL:-Qwen/Qwen2.5-32B}
CONFIG=${CONFIG:-examples/grpo_math_qwen32b.yaml}
TRANSPORT=${TRANSPORT:-nccl}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-16384}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.9}
SEED=${SEED:-0}
PYTHON=${PYTHON:-.venv/bin/python}
VLLM_PYTHON=${VLLM_PYTHON:-.venv-vllm/bin/python}
SERVER_WAIT_S=${SERVER_WAIT_S:-1800}
LOG_DIR=${LOG_DIR:-logs/grpo_math_qwen32b}
DRY_RUN=${DRY_RUN:-0}

for name in NNODES TRAIN_NODES NODE_RANK MASTER_PORT GPUS_PER_NODE SERVERS_PER_NODE VLLM_PORT MAX_MODEL_LEN SEED SERVER_WAIT_S; do
  [[ "${!name}" =~ ^[0-9]+$ ]] || fail "$name must be a whole number, got '${!name}'"
done
((SERVERS_PER_NODE >= 1)) || fail "SERVERS_PER_NODE must be at least 1"
TP=${TP:-$((GPUS_PER_NODE / SERVERS_PER_NODE))}
[[ "$TP" =~ ^[1-9][0-9]*$ ]] || fail "TP must be a whole number >= 1, got '$TP'"
((TRAIN_NODES >= 1 && TRAIN_NODES < NNODES)) || fail "TRAIN_NODES must be in 1 .. NNODES-1 ($NNODES - 1), got $TRAIN_NODES"
((NODE_RANK < NNODES)) || fail "NODE_RANK must be in 0 .. NNODES-1 ($NNODES - 1), got $NODE_RANK"
((SERVERS_PER_NODE * TP <= GPUS_PER_NODE)) || fail "SERVERS_PER_NODE x TP ($SERVERS_PER_NODE x $TP) is more than GPUS_PER_NODE ($GPUS_PER_NODE)"
read -r -a rollout_hosts <<<"$ROLLOUT_HOSTS"
((${#rollout_hosts[@]} == NNODES - TRAIN_NODES)) ||
  fail "ROLLOUT_HOSTS names ${#rollout_hosts[@]} hosts; NNODES - TRAIN_NODES = $((NNODES - TRAIN_NODES)) rollout nodes need one each"
case "$TRANSPORT" in
  nccl) backend=nccl ;;
  http) backend=llmrl ;;
  disk)
    backend=llmrl
    [[ -n "${WEIGHTS_DIR:-}" ]] || fail "TRANSPORT=disk needs WEIGHTS_DIR, a folder every node sees"
    ;;
  *) fail "TRANSPORT must be nccl, http or disk, got '$TRANSPORT'" ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Print a command (DRY_RUN=1) or run it.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

serve() {
  local index=$((NODE_RANK - TRAIN_NODES)) pids=() server first devices port
  [[ "$DRY_RUN" == 1 ]] || mkdir -p "$LOG_DIR"  # a dry run only prints
  trap 'kill "${pids[@]}" 2>/dev/null || true; wait' EXIT
  trap 'exit 143' TERM INT
  for ((server = 0; server < SERVERS_PER_NODE; server++)); do
    first=$((server * TP))
    devices=$(seq -s, "$first" $((first + TP - 1)))
    port=$((VLLM_PORT + server))
    local command=(env "CUDA_VISIBLE_DEVICES=$devices" VLLM_SERVER_DEV_MODE=1
      "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server
      --model "$MODEL" --dtype bfloat16 --seed "$SEED" --host 0.0.0.0 --port "$port"
      --logprobs-mode processed_logprobs
      --worker-extension-cls llmrl.weights.vllm_worker.LlmrlWorkerExtension
      --weight-transfer-config "{\"backend\": \"$backend\"}"
      --tensor-parallel-size "$TP" --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION"
      --max-model-len "$MAX_MODEL_LEN")
    if [[ "$DRY_RUN" == 1 ]]; then
      run "${command[@]}"
    else
      local log="$LOG_DIR/node$index-server$server.log"
      echo "rollout node $index: server $server on GPUs $devices, port $port, log $log"
      "${command[@]}" >"$log" 2>&1 &
      pids+=($!)
    fi
  done
  if [[ "$DRY_RUN" != 1 ]]; then
    wait -n "${pids[@]}" || true # the first server to exit ends the node's job (and the others)
    echo "a vLLM server on this node exited; see $LOG_DIR" >&2
    exit 1
  fi
}

train() {
  local urls=() host server url quoted=() deadline
  for host in "${rollout_hosts[@]}"; do
    for ((server = 0; server < SERVERS_PER_NODE; server++)); do
      urls+=("http://$host:$((VLLM_PORT + server))")
    done
  done
  for url in "${urls[@]}"; do
    quoted+=("\"$url\"")
  done
  local IFS=,
  local base_url="[${quoted[*]}]"
  unset IFS
  if [[ "$DRY_RUN" != 1 ]]; then
    command -v curl >/dev/null || fail "curl is needed to wait for the vLLM servers"
    deadline=$((SECONDS + SERVER_WAIT_S))
    for url in "${urls[@]}"; do
      until curl -sf -o /dev/null "$url/health"; do
        ((SECONDS < deadline)) || fail "$url did not answer /health within ${SERVER_WAIT_S}s (SERVER_WAIT_S)"
        sleep 10
      done
      echo "$url is up"
    done
  fi
  local extra=()
  [[ "$TRANSPORT" == disk ]] && extra+=(--set "inference.weights_dir=$WEIGHTS_DIR")
  run "$PYTHON" -m torch.distributed.run --nnodes "$TRAIN_NODES" --nproc-per-node "$GPUS_PER_NODE" \
    --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m llmrl train "$CONFIG" --set "inference.base_url=$base_url" \
    --set "inference.vllm.transport=$TRANSPORT" ${extra[@]+"${extra[@]}"} "$@"
}

if ((NODE_RANK < TRAIN_NODES)); then
  train "$@"
else
  serve
fi
