#!/usr/bin/env bash
# `make run`: starts the trainer and the gateway as two processes on localhost (SQLite store
# under var/), then, unless DEMO=0, creates a demo imitation run, watches it live, draws its
# learning curve and avatar, says where the trained model is and how to download it, prints
# grpcurl lines to try, and keeps both services up until Ctrl+C. Checkpoints go to $VAR/checkpoints.
# DEMO=grpo runs the GRPO demo instead: it builds the offline tiny VLM and a colour dataset under
# $VAR/data (once), trains 200 steps with exact_match and draws the learning curve.
#
# Environment: DEMO (1, grpo or 0), GATEWAY_PORT (50051), TRAINER_PORT (50052), HTTP_PORT (8080:
# the page and the JSON API of the gateway), METRICS (1: expose
# Prometheus metrics on GATEWAY_METRICS_PORT 9151 / TRAINER_METRICS_PORT 9152),
# DEMO_EPISODES (300; 200 for grpo), DEMO_RATE (20 episodes/s), DEMO_CLIP (wave), VAR (var),
# STAY_UP (1: keep serving after the demo; 0 exits once the demo is done, for tests),
# DB (sqlite; postgres: a local PostgreSQL under $VAR/postgres and two gateway replicas sharing
# it, the second on REPLICA_PORT (50053) / REPLICA_HTTP_PORT (8081); the demo run is watched on
# the second).
set -euo pipefail
cd "$(dirname "$0")/.."

# From a terminal, the script runs as a job of its own in the foreground: Ctrl+C then reaches it
# and the services (which stop cleanly, and the script exits 0), not make, which would otherwise
# report "make: *** [run] Interrupt" and exit 130 for a stop that was asked for.
if [[ -t 0 && -z ${TRAINWIRE_RUN_JOB:-} ]]; then
  set -m
  TRAINWIRE_RUN_JOB=1 bash "$0" "$@" &
  fg %1 >/dev/null
  exit $?
fi

PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
VAR=${VAR:-var}
DEMO=${DEMO:-1}
STAY_UP=${STAY_UP:-1}
GATEWAY_PORT=${GATEWAY_PORT:-50051}
TRAINER_PORT=${TRAINER_PORT:-50052}
HTTP_PORT=${HTTP_PORT:-8080}
METRICS=${METRICS:-1}
if [[ $DEMO == grpo ]]; then
  DEMO_EPISODES=${DEMO_EPISODES:-200}
else
  DEMO_EPISODES=${DEMO_EPISODES:-300}
fi
DEMO_RATE=${DEMO_RATE:-20}
DEMO_CLIP=${DEMO_CLIP:-wave}
DB=${DB:-sqlite}
mkdir -p "$VAR/logs" "$VAR/data"

pids=()
db_pids=()  # the database: stopped after the services that use it
cleanup() {
  trap - INT TERM EXIT
  if ((${#pids[@]})); then
    echo "stopping services..."
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  fi
  if ((${#db_pids[@]})); then
    kill -TERM "${db_pids[@]}" 2>/dev/null || true
    wait "${db_pids[@]}" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'cleanup; exit 0' INT TERM  # a stop that was asked for is a clean exit

# Waits for "<what> listening on HOST:PORT" in a log and prints HOST:PORT.
wait_listening() {
  local what=$1 log=$2 pid=$3
  for _ in $(seq 1 600); do
    if addr=$(grep -m1 -oE "^$what listening on [^ ]+" "$log" 2>/dev/null); then
      echo "${addr##* }"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$what failed to start; its log ($log):" >&2
      tail -n 30 "$log" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "$what did not start within 60 s; see $log" >&2
  return 1
}

# Prints the page's URL the gateway logged ("gateway http on http://HOST:PORT").
http_url() {
  local log=$1 url
  for _ in $(seq 1 50); do
    if url=$(grep -m1 -oE "^gateway http on http://[^ ]+" "$log" 2>/dev/null); then
      echo "${url##* }"
      return 0
    fi
    sleep 0.1
  done
  echo "(none: see $log)"
}

# Prints the metrics URL a service logged ("<what> metrics on http://HOST:PORT/metrics").
metrics_url() {
  local what=$1 log=$2 url
  for _ in $(seq 1 50); do
    if url=$(grep -m1 -oE "^$what metrics on http://[^ ]+" "$log" 2>/dev/null); then
      echo "${url##* }"
      return 0
    fi
    sleep 0.1
  done
  echo "(none: see $log)"
}

# Says where a finished run's trained model is and how to download it.
trained_model() {
  local run_id=$1
  "$BIN/trainwire" runs checkpoints "$run_id" || true
  echo "trained model: the run's last checkpoint, stored under $checkpoints/$run_id/"
  echo "  download it: $BIN/trainwire runs download $run_id --out $VAR/models/$run_id"
  echo "  or over HTTP: $page/v1/runs/$run_id/checkpoints/0:download (a tar; 0 = the latest)"
}

trainer_metrics=() gateway_metrics=()
if [[ $METRICS == 1 ]]; then
  trainer_metrics=(--metrics-port "${TRAINER_METRICS_PORT:-9152}")
  gateway_metrics=(--metrics-port "${GATEWAY_METRICS_PORT:-9151}")
fi

# Both services share one checkpoint store: the trainer writes the trained models there, the
# gateway records them and serves their downloads.
checkpoints="$VAR/checkpoints"
"$PY" -m trainer_service --host 127.0.0.1 --port "$TRAINER_PORT" --slots 1 --device auto \
  --data-root "$VAR/data" --checkpoint-store "$checkpoints" "${trainer_metrics[@]}" \
  >"$VAR/logs/trainer.log" 2>&1 &
pids+=($!)
trainer=$(wait_listening trainer "$VAR/logs/trainer.log" "${pids[-1]}")

db="$VAR/trainwire.sqlite3"
if [[ $DB == postgres ]]; then
  "$PY" scripts/dev_postgres.py "$VAR/postgres" >"$VAR/logs/postgres.log" 2>&1 &
  db_pids+=($!)
  db=$(wait_listening postgres "$VAR/logs/postgres.log" "${db_pids[-1]}")
fi

"$PY" -m gateway --host 127.0.0.1 --port "$GATEWAY_PORT" --http-port "$HTTP_PORT" \
  --trainer "$trainer" --db "$db" --migrate --checkpoint-store "$checkpoints" \
  "${gateway_metrics[@]}" >"$VAR/logs/gateway.log" 2>&1 &
pids+=($!)
gateway=$(wait_listening gateway "$VAR/logs/gateway.log" "${pids[-1]}")

echo "trainer  on $trainer  (log $VAR/logs/trainer.log)"
echo "gateway  on $gateway  (log $VAR/logs/gateway.log)"
watch_on=$gateway
if [[ $DB == postgres ]]; then
  # A second replica on the same database: it answers for every run, drives its share, and
  # takes the first one's runs over if that one stops.
  replica_metrics=()
  [[ $METRICS == 1 ]] && replica_metrics=(--metrics-port 0)
  "$PY" -m gateway --host 127.0.0.1 --port "${REPLICA_PORT:-50053}" \
    --http-port "${REPLICA_HTTP_PORT:-8081}" --trainer "$trainer" --db "$db" \
    --checkpoint-store "$checkpoints" "${replica_metrics[@]}" \
    >"$VAR/logs/gateway-2.log" 2>&1 &
  pids+=($!)
  watch_on=$(wait_listening gateway "$VAR/logs/gateway-2.log" "${pids[-1]}")
  echo "replica  on $watch_on  (log $VAR/logs/gateway-2.log; both on PostgreSQL, log $VAR/logs/postgres.log)"
fi
page=$(http_url "$VAR/logs/gateway.log")
echo "page     on $page/  (runs, live curves, controls: open it in a browser)"
export TRAINWIRE_GATEWAY=$gateway

if [[ $DEMO == grpo ]]; then
  # The offline tiny VLM (random weights) and a four-colour dataset, built once under the data root.
  [[ -f $VAR/data/models/tiny-vlm/config.json ]] ||
    "$PY" -m trainer_service.tools.make_tiny_vlm "$VAR/data/models/tiny-vlm" >/dev/null
  [[ -f $VAR/data/datasets/colours/train.jsonl ]] ||
    "$PY" -m trainer_service.tools.make_demo_dataset "$VAR/data/datasets/colours" >/dev/null
  run_id=$("$BIN/trainwire" runs create grpo --model models/tiny-vlm \
    --dataset datasets/colours/train.jsonl --reward exact_match --episodes "$DEMO_EPISODES" \
    --rate "$DEMO_RATE" --seed 0 --name "demo: a tiny VLM learns to name colours" -q)
  echo "demo run $run_id: GRPO from random weights; reward = exact_match (chance 0.25)"
  "$BIN/trainwire" watch "$run_id" || true
  "$BIN/trainwire" plot "$run_id" --out "$VAR/demo-curve.png"
  echo "picture: $VAR/demo-curve.png"
  trained_model "$run_id"
elif [[ $DEMO != 0 ]]; then
  run_id=$("$BIN/trainwire" runs create imitation --clip "$DEMO_CLIP" --episodes "$DEMO_EPISODES" \
    --rate "$DEMO_RATE" --seed 0 --name "demo: stickman learns to $DEMO_CLIP" -q)
  echo "demo run $run_id: watching on $watch_on (Ctrl+C stops the services; what it trained is kept in $db)"
  echo "  in a browser: $page/#/runs/$run_id"
  "$BIN/trainwire" --gateway "$watch_on" watch "$run_id" || true
  "$BIN/trainwire" plot "$run_id" --out "$VAR/demo-curve.png"
  "$BIN/trainwire" avatar "$run_id" --out "$VAR/demo-avatar.png"
  echo "pictures: $VAR/demo-curve.png $VAR/demo-avatar.png"
  trained_model "$run_id"
fi

cat <<EOF

Try it with grpcurl (.venv/bin/grpcurl):
  $BIN/grpcurl -plaintext $gateway list
  $BIN/grpcurl -plaintext $gateway describe trainwire.v1.GatewayService
  $BIN/grpcurl -plaintext -d '{"task": {"imitation": {"clip_name": "walk"}}, "config": {"max_episodes": 200}}' $gateway trainwire.v1.GatewayService/CreateRun
  $BIN/grpcurl -plaintext -d '{"run_id": "RUN_ID"}' $gateway trainwire.v1.GatewayService/WatchRun
  $BIN/grpcurl -plaintext $trainer trainwire.v1.TrainerService/GetCapabilities
  $BIN/grpcurl -plaintext $gateway grpc.health.v1.Health/Check
or the CLI: $BIN/trainwire --gateway $gateway runs list
EOF
if [[ $METRICS == 1 ]]; then
  echo "Prometheus metrics: $(metrics_url gateway "$VAR/logs/gateway.log") (gateway)," \
    "$(metrics_url trainer "$VAR/logs/trainer.log") (trainer)"
fi

echo "Watch and steer runs in a browser: $page/"

if [[ $STAY_UP == 1 ]]; then
  echo "services are up; Ctrl+C stops them"
  wait "${pids[@]}"
fi
