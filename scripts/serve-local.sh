#!/usr/bin/env bash
# Starts a worker and a scheduler on 127.0.0.1 and serves until Ctrl-C.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
MODE=${MODE:-overlap}
WORKER_PORT=${WORKER_PORT:-50061}
PORT=${PORT:-50051}
HTTP_PORT=${HTTP_PORT:-8000}
TP=${TP:-1}

"$PY" -m worker_svc --model "$MODEL" --port "$WORKER_PORT" --tp "$TP" &
worker=$!
trap 'kill -TERM $worker 2>/dev/null; wait $worker 2>/dev/null' EXIT INT TERM

cat <<MSG

  Stepahead is starting (model $MODEL on $TP rank(s), mode $MODE). Once it listens, chat with it:
    $PY -m stepahead_client --chat "What is the capital of France?" --server 127.0.0.1:$PORT
    curl -s http://127.0.0.1:$HTTP_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "$MODEL", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
  Ctrl-C stops both services.

MSG
"$PY" -m scheduler_svc --worker "127.0.0.1:$WORKER_PORT" --port "$PORT" --http-port "$HTTP_PORT" --mode "$MODE"
