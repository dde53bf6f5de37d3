"""Prometheus metrics under the `tokenmill:` prefix (vLLM's metric names, our prefix).

The engine's gauges and counters mirror the engine core's cumulative stats and are read at scrape time
by a collector; the token counters and the request histograms are observed in the server process as
outputs arrive, from the tokens its requests received, as vLLM's frontend counts them: the core also
counts the tokens it samples for a sequence a stop string or its client has already ended, which no
output holds. Everything
lives in a per-server `CollectorRegistry`, never in the global default registry.

With several API server processes (`--api-server-count`), prometheus_client runs in its multiprocess
mode (PROMETHEUS_MULTIPROC_DIR, set by the parent before they start): each process writes its histograms
and counters to files there, and a scrape of any process sums them all. The engine's gauges and counters
come from the core's stats, the same in every process, so they are rendered by the scraped process alone.
"""
from __future__ import annotations

import itertools
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from tokenmill.engine.async_engine import RequestAbortedError
from tokenmill.engine.step_outputs import ITERATION_TOKENS_BUCKETS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# up to two hours, as vLLM's request latency buckets reach: a long reasoning answer or a deep queue
# past the last bucket would read as that bucket's bound in every quantile
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0, 7680.0)
# up to 80 s, as vLLM's: a gap spent preempted or swapped out past the last bucket would read as 5 s
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


FINISH_REASONS = ("stop", "length", "abort", "error")
# the codes of the 503s that refuse a request before it reaches the engine (server/: serving.py, engine_streams.py,
# connections.py)
REJECT_REASONS = ("queue_full", "shutting_down", "engine_dead", "logprobs_in_flight", "engine_busy",
                  "too_many_connections")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for token counts, whose last bound is
    the model's context length (no request can pass it)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


# stats key -> (metric name, help, kind)
_STATS = {
    "num_running": ("tokenmill:num_requests_running", "Requests in the running batch.", "gauge"),
    "num_waiting": ("tokenmill:num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    "kv_cache_usage": ("tokenmill:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", "gauge"),
    "num_free_blocks": ("tokenmill:num_free_blocks", "Free KV-cache blocks.", "gauge"),
    "num_total_blocks": ("tokenmill:num_total_blocks", "KV-cache blocks in total.", "gauge"),
    "prefix_cache_queries": ("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter"),
    "prefix_cache_hits": ("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter"),
    "num_preemptions": ("tokenmill:num_preemptions", "Requests preempted for lack of KV blocks.", "counter"),
    "num_swapped": ("tokenmill:num_requests_swapped", "Requests swapped out to CPU memory.", "gauge"),
    "cpu_cache_usage": ("tokenmill:cpu_cache_usage_perc", "Fraction of swap-space blocks in use (0..1).", "gauge"),
    "swapped_out_blocks": ("tokenmill:swapped_out_blocks", "KV blocks copied to the swap space.", "counter"),
    "swapped_in_blocks": ("tokenmill:swapped_in_blocks", "KV blocks copied back from the swap space.", "counter"),
    "swap_out_bytes": ("tokenmill:swap_out_bytes", "Bytes copied to the swap space.", "counter"),
    "swap_in_bytes": ("tokenmill:swap_in_bytes", "Bytes copied back from the swap space.", "counter"),
}

# the same gauges under vLLM's own names, which vLLM-aware inference gateways (routing by queue and cache)
# and autoscaler recipes read; gpu_cache_usage_perc is vLLM's older name for kv_cache_usage_perc
_VLLM_NAMES = {
    "num_running": ("vllm:num_requests_running",),
    "num_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}


class _StatsCollector:
    def __init__(self, get_stats: Callable[[], dict], model_name: str, extra: Callable[[], dict]):
        self._get_stats = get_stats
        self._model = model_name
        self._extra = extra

    def collect(self):
        stats = self._get_stats() or {}
        for key, (name, doc, kind) in _STATS.items():
            if key not in stats:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=["model_name"])
            family.add_metric([self._model], float(stats[key]))
            yield family
            for alias in _VLLM_NAMES.get(key, ()):
                g = GaugeMetricFamily(alias, f"{doc} (tokenmill's {name}, under vLLM's name)", labels=["model_name"])
                g.add_metric([self._model], float(stats[key]))
                yield g
        counts = stats.get("iteration_tokens")
        if counts:
            # per bucket in the engine's stats (the last past every bound), cumulative on the page; the steps'
            # tokens are the prompt and generation tokens the engine counts, so those give the sum
            h = HistogramMetricFamily("tokenmill:iteration_tokens_total", "Tokens per engine step: the prompts "
                                      "of the sequences it sampled a first token for, and the tokens it generated.",
                                      labels=["model_name"])
            bounds = [floatToGoString(b) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
            h.add_metric([self._model], list(zip(bounds, itertools.accumulate(counts))),
                         stats.get("prompt_tokens", 0) + stats.get("generation_tokens", 0))
            yield h
        for name, (doc, value) in self._extra().items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(value))
            yield g
        yield from _gpu_metrics()


class ServerMetrics:
    """All metrics of one server; `observe_output` is the `AsyncLLM` output hook."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict],
                 extra: Callable[[], dict] | None = None, multiprocess_dir: str | None = None,
                 max_model_len: int = 1 << 20):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # multiprocess: this process's histograms and counters are read back from the directory's files,
        # with every other process's, so they are registered nowhere
        own = self.registry if multiprocess_dir is None else None
        if multiprocess_dir is not None:
            MultiProcessCollector(self.registry, path=multiprocess_dir)
        labels = ["model_name"]
        kw = dict(labelnames=labels, registry=own)
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds",
                             "Time between consecutive generated tokens.",
                             buckets=_ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.queue = Histogram("tokenmill:request_queue_time_seconds",
                               "Time from arrival to first scheduling.", buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        # per finished sequence, as vLLM's (its dashboard's prefill/decode and length panels read these)
        self.prefill = Histogram("tokenmill:request_prefill_time_seconds",
                                 "Time from first scheduling to the first generated token.",
                                 buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.decode = Histogram("tokenmill:request_decode_time_seconds",
                                "Time from the first generated token to the last.",
                                buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.inference = Histogram("tokenmill:request_inference_time_seconds",
                                   "Time from first scheduling to the last generated token (prefill + decode).",
                                   buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_len = Histogram("tokenmill:request_prompt_tokens", "Prompt tokens of a finished sequence.",
                                    buckets=token_buckets, **kw).labels(model_name)
        self.generation_len = Histogram("tokenmill:request_generation_tokens",
                                        "Tokens generated by a finished sequence.",
                                        buckets=token_buckets, **kw).labels(model_name)
        self.max_tokens = Histogram("tokenmill:request_params_max_tokens",
                                    "The max_tokens parameter of a finished sequence (when set).",
                                    buckets=token_buckets, **kw).labels(model_name)
        # per request, once its last sequence has finished
        self.params_n = Histogram("tokenmill:request_params_n", "The n parameter of a finished request.",
                                  buckets=(1, 2, 5, 10, 20), **kw).labels(model_name)
        self.max_generation_len = Histogram("tokenmill:request_max_num_generation_tokens",
                                            "Most tokens generated by one sequence of a finished request.",
                                            buckets=token_buckets, **kw).labels(model_name)
        # vLLM's: a sequence's prompt once its first token has come, and each token it received
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prefill tokens processed.",
                                     **kw).labels(model_name)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated.",
                                         **kw).labels(model_name)
        self.finished = Counter("tokenmill:request_success", "Finished sequences (choices) by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=own)
        self.rejected = Counter("tokenmill:request_rejected", "Requests refused before reaching the engine "
                                "(503: queue full, shutting down, engine dead, logprobs in flight, "
                                "engine busy, too many connections).",
                                labelnames=["model_name", "reason"], registry=own)
        # every series from the start at 0, as vLLM's, so that rate() and increase() see each first event
        for reason in FINISH_REASONS:
            self.finished.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(model_name, reason)
        self.registry.register(_StatsCollector(get_stats, model_name, extra or dict))

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def observe_output(self, stream, out, now: float):
        """Called for every update of a request (its cumulative output `out`), and with `out` None when it
        ends unfinished: its client gone ("abort"), or failed by the engine, the engine dead or the server
        stopping ("error", vLLM's reason for a request the server could not finish). Each sequence (choice)
        of a request counts as one, as vLLM counts the n child requests of one: its time to first token,
        its gaps between tokens, its tokens, and once it finishes its latency, finish reason, queue time,
        lengths and prefill/decode times. The request's n and its longest sequence count once, when its
        last sequence finishes."""
        if out is None:
            reason = "abort" if stream.error is None or isinstance(stream.error, RequestAbortedError) else "error"
            for i in range(stream.n):
                if i not in stream.finished_seen:
                    self._finish_sequence(stream, i, reason, now, stream.metrics)
            return
        m = out.metrics
        seen = stream.prev_tokens
        if len(seen) < len(out.outputs):
            grow = len(out.outputs) - len(seen)
            seen += [0] * grow
            stream.last_token_seen += [None] * grow
            stream.first_token_seen += [None] * grow
        for i, o in enumerate(out.outputs):
            n_tokens = len(o.token_ids)
            if n_tokens <= seen[i]:
                continue
            self.generation_tokens.inc(n_tokens - seen[i])
            if not seen[i]:
                self.prompt_tokens.inc(stream.num_prompt_tokens)
                first = m.first_token_time if i == 0 and m.first_token_time else now
                stream.first_token_seen[i] = first
                self.ttft.observe(max(0.0, first - m.arrival_time))
            else:
                last = stream.last_token_seen[i]
                gap = (now - last) / (n_tokens - seen[i])
                for _ in range(n_tokens - seen[i]):
                    self.itl.observe(gap)
            seen[i] = n_tokens
            stream.last_token_seen[i] = now
        for i, o in enumerate(out.outputs):
            if (o.finish_reason is not None or out.finished) and i not in stream.finished_seen:
                end = (m.finished_time or now) if out.finished else now
                self._finish_sequence(stream, i, o.finish_reason or "unknown", end, m)

    def _finish_sequence(self, stream, i: int, reason: str, end: float, m) -> None:
        """Sequence `i` has finished at `end`; `m`: its request's `RequestMetrics`. As vLLM's, the queue
        time runs from arrival to the first scheduling, prefill and decode from there to the sequence's
        first token and from there to its last; each is observed where both its ends happened (a
        sequence aborted while queued has none, one aborted before its first token a queue time only)."""
        stream.finished_seen.add(i)
        self.e2e.observe(max(0.0, end - m.arrival_time))
        self.finished.labels(self.model_name, reason).inc()
        n_tokens = stream.prev_tokens[i] if i < len(stream.prev_tokens) else 0
        self.prompt_len.observe(stream.num_prompt_tokens)
        self.generation_len.observe(n_tokens)
        if stream.max_tokens:
            self.max_tokens.observe(stream.max_tokens)
        scheduled = m.first_scheduled_time
        if scheduled is not None:
            self.queue.observe(max(0.0, scheduled - m.arrival_time))
            first = stream.first_token_seen[i] if i < len(stream.first_token_seen) else None
            if first is not None:
                last = stream.last_token_seen[i]
                self.prefill.observe(max(0.0, first - scheduled))
                self.decode.observe(max(0.0, last - first))
                self.inference.observe(max(0.0, last - scheduled))
        if len(stream.finished_seen) == stream.n:
            self.params_n.observe(stream.n)
            self.max_generation_len.observe(max(stream.prev_tokens, default=0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _gpu_metrics():
    try:
        import pynvml
    except ImportError:
        return
    try:
        pynvml.nvmlInit()
        used = GaugeMetricFamily("tokenmill:gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu"])
        total = GaugeMetricFamily("tokenmill:gpu_memory_total_bytes", "GPU memory in total.", labels=["gpu"])
        util = GaugeMetricFamily("tokenmill:gpu_utilization_perc", "GPU utilisation (0..1).", labels=["gpu"])
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            used.add_metric([str(i)], float(mem.used))
            total.add_metric([str(i)], float(mem.total))
            util.add_metric([str(i)], pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
    except Exception:
        return
    yield used
    yield total
    yield util
