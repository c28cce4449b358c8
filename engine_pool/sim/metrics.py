"""The simulated engine's Prometheus metrics, under vLLM V1's own names and labels.

From ``vllm/v1/metrics/loggers.py``: gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full), the
histogram ``vllm:time_to_first_token_seconds`` (vLLM's buckets) and the counters
``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``, all labelled
``model_name`` and ``engine`` (the engine index, ``"0"``). Times are simulated seconds.
One registry per engine: no module-level state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine_pool.sim.scheduler import SchedulerSnapshot

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
LABELS = ("model_name", "engine")


class SimMetrics:
    def __init__(self, model_name: str, engine_index: str = "0") -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        values = (model_name, engine_index)
        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            LABELS,
            registry=r,
        ).labels(*values)
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            LABELS,
            registry=r,
        ).labels(*values)
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            LABELS,
            registry=r,
        ).labels(*values)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(*values)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        ).labels(*values)

    def render(self, snapshot: SchedulerSnapshot) -> bytes:
        """The exposition text, with the gauges read from the scheduler right now."""
        self._running.set(snapshot.running)
        self._waiting.set(snapshot.waiting)
        self._kv_usage.set(snapshot.kv_usage)
        return generate_latest(self.registry)
