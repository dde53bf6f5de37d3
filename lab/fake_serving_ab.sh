#!/usr/bin/env bash
# The serving path alone (lab/fake_engine.py): one and two API servers, concurrency 64 and 256, two runs each;
# one line per level: API servers, the requests the engine held per step, then bench serve's row. Run from
# the repository root on a CPU machine: bash lab/fake_serving_ab.sh
cd "$(dirname "$0")/.."
for run in 1 2; do
for n in 1 2; do
  pkill -f "port 8123"; sleep 2
  rm -f /tmp/fake.stats
  FAKE_STEP_MS=8 FAKE_STATS_OUT=/tmp/fake.stats PYTHONPATH=lab:src nohup python -m tokenmill.cli serve src/tokenmill/assets/tiny --port 8123 --log-level warning --api-server-count $n --engine-factory fake_engine:make > /tmp/fake_serve.log 2>&1 &
  for i in $(seq 60); do curl -s -m 1 localhost:8123/health >/dev/null && break; sleep 1; done
  for c in 64 256; do
    sleep 1.5; a=$(cat /tmp/fake.stats 2>/dev/null || echo "0 0")
    line=$(PYTHONPATH=src timeout 200 python -m tokenmill.bench serve --base-url http://127.0.0.1:8123 --endpoint /v1/chat/completions --dataset random --input-len-range 64:256 --output-len-range 200:200 --num-prompts $((c*4)) --max-concurrency $c --no-progress --output-dir /tmp/fb --name r$run-n$n-c$c 2>&1 | grep "^| tokenmill")
    sleep 1.5; b=$(cat /tmp/fake.stats)
    rows=$(python -c "a='$a'.split(); b='$b'.split(); print(round((int(b[1])-int(a[1]))/max(int(b[0])-int(a[0]),1),1))")
    echo "run $run | api servers $n | rows/step $rows $line"
  done
done
done
pkill -f "port 8123"
