"""`bench serve`'s metrics: one request's timings (`RequestResult`) and a level's figures under vLLM's keys
(throughputs, goodput, TTFT/TPOT/ITL/E2E statistics at the chosen percentiles, the peaks), the per-request
lists of `--save-detailed`, and the statistics of one class of requests (tool-carrying or plain)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tokenmill.bench.serve_datasets import ServeRequest

PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0               # seconds
    latency: float = 0.0            # seconds
    itl: list[float] = field(default_factory=list)
    start: float = 0.0              # seconds since the level began
    usage_reported: bool = False
    error: str = ""
    generated_text: str = ""


def tpot_of(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...] = PERCENTILES) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:         # vLLM's key: p99, p99.9
        out[f"p{int(p) if p == int(p) else p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = PERCENTILES) -> dict:
    """vLLM's metrics of one level under vLLM's keys (`duration` in seconds, latencies in ms), and ours beside
    them."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    duration_s = max(duration_s, 1e-9)
    m = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "request_goodput": None,
        "output_throughput": total_out / duration_s, "total_token_throughput": (total_in + total_out) / duration_s,
        **peak_output(ok),
    }
    m.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    m.update(_stats("tpot", tpots, percentiles))
    m.update(_stats("itl", [g for r in ok for g in r.itl], percentiles))
    m.update(_stats("e2el", [r.latency for r in ok], percentiles))
    m.update({"num_requests": len(results), "success_rate": len(ok) / len(results) if results else 0.0,
              "requests_without_usage": sum(1 for r in ok if not r.usage_reported)})
    m["max_ttft_ms"] = max((r.ttft for r in ok), default=0.0) * 1e3
    m["max_e2el_ms"] = max((r.latency for r in ok), default=0.0) * 1e3
    if slos:
        good = 0
        for r in ok:
            t = tpot_of(r) or 0.0
            if (r.ttft * 1e3 <= slos.get("ttft", math.inf) and t * 1e3 <= slos.get("tpot", math.inf)
                    and r.latency * 1e3 <= slos.get("e2el", math.inf)):
                good += 1
        m["goodput_slos_ms"] = dict(slos)
        m["good_requests"] = good
        m["request_goodput"] = good / duration_s
    return m


def detailed(requests: list[ServeRequest], results: list[RequestResult]) -> dict:
    """vLLM's --save-detailed lists, one entry per request in the order sent (seconds; `start_times` from
    the level's start)."""
    return {"input_lens": [r.prompt_tokens or q.prompt_len or 0 for q, r in zip(requests, results)],
            "output_lens": [r.output_tokens if r.success else 0 for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results], "start_times": [r.start for r in results],
            "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results]}


def peak_output(ok: list[RequestResult]) -> dict:
    """vLLM's peaks of a level's completed requests: `max_output_tokens_per_s`, the most output chunks timed
    in one whole second counted from the first request's start (a chunk is a token at one token a chunk, as
    vLLM counts them), and `max_concurrent_requests`, the most requests in flight at once, each over
    [start, start + latency)."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in ok)
    times = np.concatenate([r.start + r.ttft + np.cumsum([0.0, *r.itl]) for r in ok]) - t0
    per_second = np.bincount(np.maximum(times, 0.0).astype(np.int64))
    # a request that ends as another starts is not beside it: at equal times the end comes first
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    in_flight = np.cumsum([delta for _, delta in events])
    return {"max_output_tokens_per_s": float(per_second.max()), "max_concurrent_requests": int(in_flight.max())}


def class_metrics(results: list[RequestResult], rows: set[int], part: str) -> dict:
    """TTFT and E2E statistics of the requests at `rows` of `results`, each key suffixed with `_{part}`."""
    ok = [results[i] for i in sorted(rows) if results[i].success]
    m = {"completed": len(ok), "num_requests": len(rows), **_stats("ttft", [r.ttft for r in ok]),
         **_stats("e2el", [r.latency for r in ok]),
         "max_ttft_ms": max((r.ttft for r in ok), default=0.0) * 1e3,
         "max_e2el_ms": max((r.latency for r in ok), default=0.0) * 1e3}
    return {f"{k}_{part}": v for k, v in m.items()}
