# Sourced by the peer comparisons: one server up at a time, its pid in SERVER_PID.
# stop_server stops it (also on exit); wait_healthy waits for its OpenAI model list.

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

wait_healthy() {  # $1: base URL, $2: log file
  for _ in $(seq 600); do
    if curl -sf "$1/v1/models" >/dev/null; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "server died, see $2" >&2; tail -20 "$2" >&2; return 1; fi
    sleep 1
  done
  echo "server not up after 600 s, see $2" >&2
  return 1
}
