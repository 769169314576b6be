#!/usr/bin/env bash
# Starts a worker and a scheduler on 127.0.0.1 and serves until Ctrl-C.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-tiny}
MODE=${MODE:-overlap}
WORKER_PORT=${WORKER_PORT:-50061}
PORT=${PORT:-50051}

"$PY" -m worker_svc --model "$MODEL" --port "$WORKER_PORT" &
worker=$!
trap 'kill -TERM $worker 2>/dev/null; wait $worker 2>/dev/null' EXIT INT TERM

cat <<MSG

  Stepahead is starting (model $MODEL, mode $MODE). Send a request with:
    $PY -m scheduler_svc.client "Hello" --max-new-tokens 32 --server 127.0.0.1:$PORT
  Ctrl-C stops both services.

MSG
"$PY" -m scheduler_svc --worker "127.0.0.1:$WORKER_PORT" --port "$PORT" --mode "$MODE"
