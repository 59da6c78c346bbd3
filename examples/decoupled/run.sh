#!/usr/bin/env bash
# Train with generation and scoring in separate processes, all on this machine (loopback):
#   1. an inference server (OpenAI-compatible) serving the tiny model, synced by files in a shared folder;
#   2. an environment server serving the arithmetic task, calling the inference server;
#   3. the trainer, which asks the environment server for rollouts and pushes weights to the inference server.
# Extra arguments go to `llmrl train`, e.g.  bash examples/decoupled/run.sh --set training.steps=20
set -euo pipefail
cd "$(dirname "$0")/../.."
LLMRL="${LLMRL:-.venv/bin/llmrl}"
INFERENCE_PORT="${INFERENCE_PORT:-8000}"
ENV_PORT="${ENV_PORT:-8100}"
WEIGHTS_DIR="${WEIGHTS_DIR:-runs/decoupled-weights}"
mkdir -p "$WEIGHTS_DIR" runs

"$LLMRL" serve-inference --model tiny://arithmetic --port "$INFERENCE_PORT" --weights-dir "$WEIGHTS_DIR" \
  > runs/decoupled-inference.log 2>&1 &
inference_pid=$!
"$LLMRL" serve-env examples/decoupled/env.yaml --port "$ENV_PORT" > runs/decoupled-env.log 2>&1 &
env_pid=$!
trap 'kill $inference_pid $env_pid 2>/dev/null || true' EXIT

wait_for() {  # url, pid, log
  for _ in $(seq 600); do
    curl -sf "$1" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died; see $3" >&2; exit 1; }
    sleep 0.1
  done
  echo "no answer from $1 after 60 s; see $3" >&2
  exit 1
}
wait_for "http://127.0.0.1:$INFERENCE_PORT/healthz" "$inference_pid" runs/decoupled-inference.log
wait_for "http://127.0.0.1:$ENV_PORT/healthz" "$env_pid" runs/decoupled-env.log

"$LLMRL" train examples/decoupled/train.yaml \
  --set "inference.base_url=http://127.0.0.1:$INFERENCE_PORT/v1" \
  --set "inference.weights_dir=$WEIGHTS_DIR" \
  --set "environments.0.agent_args.url=http://127.0.0.1:$ENV_PORT" "$@"
