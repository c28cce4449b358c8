"""The simulated engine's Prometheus metrics, under vLLM V1's own names and labels.

From ``vllm/v1/metrics/loggers.py``: gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full), the
histogram ``vllm:time_to_first_token_seconds`` (vLLM's buckets) and the counters
``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``, all labelled
``model_name`` and ``engine`` (the engine index, ``"0"``). Times are simulated seconds.
Beside them, as a vLLM server exports them: ``vllm:cache_config_info`` (an info gauge set to 1
whose labels are the cache configuration: ``block_size`` and ``num_gpu_blocks``, whose product
is the KV capacity; ``log_metrics_info`` in vLLM's loggers.py) and the API server's
``http_requests_total{handler, method, status}`` (prometheus-fastapi-instrumentator: status
grouped as ``2xx``/``4xx``; /metrics, /health, /load, /ping, /version and /server_info not
counted), which counts every request the engine received, refused ones included; and
``process_start_time_seconds`` (prometheus_client's process collector, which a vLLM server
exports: when its process started, Unix seconds), here when the engine was built, moved to
now by ``restarted()`` (the server listening again after a crash or an engine-core death: a
new process, as far as anyone watching can tell).
One registry per engine: no module-level state.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


# vLLM's default KV block size on GPUs.
BLOCK_SIZE = 16
# The handlers vLLM's instrumentator leaves out of http_requests_total.
UNCOUNTED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})


class SimMetrics:
    def __init__(
        self, model_name: str, engine_index: str = "0", kv_capacity_tokens: int | None = None
    ) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        values = (model_name, engine_index)
        self.http_requests = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            ("handler", "method", "status"),
            registry=r,
        )
        self._started = Gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            registry=r,
        )
        self._started.set(time.time())
        if kv_capacity_tokens is not None:
            Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                ("block_size", "num_gpu_blocks", "engine"),
                registry=r,
            ).labels(str(BLOCK_SIZE), str(kv_capacity_tokens // BLOCK_SIZE), engine_index).set(1)
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

    def restarted(self, at: float | None = None) -> None:
        """The server came back as a new process would: its start time is now (or ``at``)."""
        self._started.set(time.time() if at is None else at)

    def render(self, snapshot: SchedulerSnapshot) -> bytes:
        """The exposition text, with the gauges read from the scheduler right now."""
        self._running.set(snapshot.running)
        self._waiting.set(snapshot.waiting)
        self._kv_usage.set(snapshot.kv_usage)
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: each request's ``http_requests_total`` sample once it is answered."""

    def __init__(self, app: ASGIApp, metrics: SimMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in UNCOUNTED:
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = f"{int(message['status']) // 100}xx"
                self.metrics.http_requests.labels(path, scope["method"], status).inc()
            await send(message)

        await self.app(scope, receive, counted)
