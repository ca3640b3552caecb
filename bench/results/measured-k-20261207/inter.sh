#!/bin/bash
# Interleaved: the target alone, the fixed k=4 schedule and the measured k, three servers up at once, one loaded at a time.
set -u
cd "$(git rev-parse --show-toplevel)"
OUT=${OUT:-results/measured-k}
mkdir -p $OUT
start() { # name port env args...
  local name=$1 port=$2 env=$3; shift 3
  env $env .venv/bin/kimi-eagle serve "$@" --port $port > $OUT/$name.log 2>&1 &
  for i in $(seq 150); do curl -sf localhost:$port/health >/dev/null && return 0; sleep 2; done
  echo "server $name did not start"; exit 1
}
start alone 8131 "KIMI_EAGLE_MEASURED_K=0" bench/results/measured-k-20261207/tiny-cpu-k4.yaml --no-draft
start fixed 8132 "KIMI_EAGLE_MEASURED_K=0" bench/results/measured-k-20261207/tiny-cpu-k4.yaml
start measured 8133 "KIMI_EAGLE_MEASURED_K=1" bench/results/measured-k-20261207/tiny-cpu-k4.yaml
lt() { .venv/bin/kimi-eagle loadtest --url http://127.0.0.1:$1 --users 1,4,16 --run-time ${RUN_TIME:-30s} --temperature $2 --out $OUT/$3 --label "$3" > $OUT/$3.txt 2>&1; }
lt 8133 1 warmup-measured-t1
for T in 0 1; do
  lt 8131 $T alone-p1-t$T
  lt 8132 $T fixed-p1-t$T
  lt 8133 $T measured-p1-t$T
done
grep "measured k" $OUT/measured.log | tail -30 > $OUT/measured-k.txt
pkill -f "port 813[123]"
