"""Prometheus metrics of one engine service: :class:`Metrics` is its ``EngineObserver``.

Each ``Metrics`` owns its own ``CollectorRegistry`` (no process-global state, so two
servers or two tests in one process never share counts). Latencies and counters are
pushed by the engine thread through the observer hooks; the live gauges (running and
waiting requests, KV pages), the prefix cache's counters (tokens looked up and found,
pages evicted), structured outputs' (grammars compiled, masks filled and their host
time) and speculative decoding's (vLLM's ``spec_decode_*``: drafts, draft tokens, accepted
tokens, accepted tokens per draft position, and the host seconds drafting took: the engine
counts them all) are read from ``service.stats()`` at scrape time by a custom collector,
never stored, so they cannot go stale. As structured outputs' counters, speculative
decoding's are there (at zero) on an engine that does not speculate; its per-position
counter has one sample per draft position (``position`` 0 to K-1), and none there.

Which hook feeds which metric (so that nothing is counted twice):

- ``on_token(first=True)``  -> TTFT histogram; ``on_token(first=False)`` -> ITL histogram.
- ``on_finish``             -> queue time, TPOT, end-to-end histograms; prompt and
  generation token counters; finished requests by reason.
- ``on_step``               -> steps, batch tokens and step seconds by mode; switches.
- ``on_preemption``         -> preemptions; ``on_startup`` -> compile seconds, executables,
  cache hits.

Expose it with ``/metrics`` on the HTTP app (``create_app(..., metrics=m)``) or on its own
port with :func:`start_metrics_server`.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shiftjax.serving.server.protocol import ServiceStats, Usage

PREFIX = "shiftjax"
log = logging.getLogger(__name__)

# Buckets wide enough for a CPU mesh (seconds per token) and fine enough for an H200
# (milliseconds per token).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    """The engine's Prometheus metrics; implements ``protocol.EngineObserver``.

    ``stats`` is the service's ``stats`` method; it may be bound later with
    :meth:`bind_stats`, since the service is built with this object as its observer.
    """

    def __init__(self, stats: Callable[[], ServiceStats] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats = stats
        self._stats_lock = threading.Lock()
        r = self.registry

        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Submit to first streamed token.", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Gap between consecutive streamed tokens of one request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Per request: (end-to-end - TTFT) / (output tokens - 1), requests with "
                              "at least two output tokens.", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}_request_queue_time_seconds",
                                    "Submit to the request's first scheduled step.",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Submit to finish.",
                             buckets=REQUEST_BUCKETS, registry=r)

        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Output tokens of finished requests.", registry=r)
        self.finished = Counter(f"{PREFIX}_request_finished", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)

        self.steps = Counter(f"{PREFIX}_steps", "Engine steps by parallel mode.", ["mode"], registry=r)
        self.step_tokens = Counter(f"{PREFIX}_step_tokens", "Tokens processed by engine steps, by mode.",
                                   ["mode"], registry=r)
        self.batch_tokens = Histogram(f"{PREFIX}_step_batch_tokens", "Tokens per engine step, by mode.",
                                      ["mode"], buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.step_seconds = Histogram(f"{PREFIX}_step_duration_seconds", "Wall time of one engine step, by mode.",
                                      ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.switches = Counter(f"{PREFIX}_mode_switches", "Steps that ran in a different mode from the step before.",
                                registry=r)
        self.preemptions = Counter(f"{PREFIX}_preemptions", "Requests preempted (pages freed, to be recomputed).",
                                   registry=r)

        # Start-up facts: set once by on_startup, which is the only time they change.
        self.compile_seconds = Gauge(f"{PREFIX}_startup_compile_seconds",
                                     "Seconds spent compiling or loading executables at start-up.", registry=r)
        self.executables = Gauge(f"{PREFIX}_startup_executables", "Executables prepared at start-up.", registry=r)
        self.cache_hits = Gauge(f"{PREFIX}_startup_compilation_cache_hits",
                                "Executables loaded from the persistent compilation cache at start-up.", registry=r)

        r.register(_ServiceStatsCollector(self._read_stats))

    def bind_stats(self, stats: Callable[[], ServiceStats]) -> None:
        """Binds the live gauges to ``service.stats`` (called at every scrape)."""
        with self._stats_lock:
            self._stats = stats

    def _read_stats(self) -> ServiceStats | None:
        with self._stats_lock:
            stats = self._stats
        if stats is None:
            return None
        try:
            return stats()
        except Exception:  # a scrape must not take the endpoint down; the gauges are simply absent
            log.exception("service.stats() failed during a metrics scrape")
            return None

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, gauges read now."""
        return generate_latest(self.registry)

    # protocol.EngineObserver

    def on_startup(self, *, compile_seconds: float, executables: int, cache_hits: int) -> None:
        self.compile_seconds.set(compile_seconds)
        self.executables.set(executables)
        self.cache_hits.set(cache_hits)

    def on_step(self, *, mode: str, num_tokens: int, num_seqs: int, seconds: float, switched: bool) -> None:
        self.steps.labels(mode).inc()
        self.step_tokens.labels(mode).inc(num_tokens)
        self.batch_tokens.labels(mode).observe(num_tokens)
        self.step_seconds.labels(mode).observe(seconds)
        if switched:
            self.switches.inc()

    def on_token(self, *, first: bool, seconds_since_previous: float) -> None:
        (self.ttft if first else self.itl).observe(seconds_since_previous)

    def on_preemption(self) -> None:
        self.preemptions.inc()

    def on_finish(self, *, usage: Usage, finish_reason: str) -> None:
        self.queue_time.observe(usage.queue_seconds)
        self.e2e.observe(usage.e2e_seconds)
        if usage.output_tokens >= 2:
            self.tpot.observe((usage.e2e_seconds - usage.ttft_seconds) / (usage.output_tokens - 1))
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.output_tokens)
        self.finished.labels(finish_reason).inc()


class _ServiceStatsCollector(Collector):
    """Gauges read from ``service.stats()`` at each scrape (none when it is not bound)."""

    def __init__(self, read_stats: Callable[[], ServiceStats | None]):
        self._read_stats = read_stats

    def describe(self):
        return []  # the families depend on a live service; nothing to check at registration

    def collect(self):
        stats = self._read_stats()
        if stats is None:
            return
        engine = stats.engine
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_running", "Requests in the running batch.",
                                value=engine.running)
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_waiting", "Requests in the admission queue.",
                                value=engine.waiting)
        yield GaugeMetricFamily(f"{PREFIX}_kv_pages", "Usable KV cache pages (the scratch page excluded).",
                                value=engine.num_pages)
        yield GaugeMetricFamily(f"{PREFIX}_kv_pages_free", "Free KV cache pages.", value=engine.free_pages)
        used = engine.num_pages - engine.free_pages
        yield GaugeMetricFamily(f"{PREFIX}_kv_page_utilization", "Fraction of usable KV pages in use (0 to 1).",
                                value=used / engine.num_pages if engine.num_pages else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}_ready", "1 when every executable is ready and the service admits requests.",
                                value=1.0 if stats.ready and not stats.draining else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}_draining", "1 while shutting down (new requests refused).",
                                value=1.0 if stats.draining else 0.0)
        # as vLLM's prefix_cache_queries and prefix_cache_hits: tokens, not requests
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache (at each request's first admission).",
                                  value=engine.prefix_cache_queries)
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=engine.prefix_cache_hits)
        yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_pages",
                                "KV pages a prefix-cache block hash names (in use, or free and reusable).",
                                value=engine.cached_pages)
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_evicted_pages",
                                  "Cached KV pages evicted to make room for new ones.", value=engine.evicted_pages)
        for name, field, help_text in _GRAMMAR_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_structured_output_{name}", help_text,
                                      value=getattr(engine.grammar, field))
        for field, help_text in _SPEC_DECODE_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_spec_decode_{field}", help_text,
                                      value=getattr(engine.speculative, field))
        per_position = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted at each draft position (0: the first).",
                                           labels=["position"])
        for position, accepted in enumerate(engine.speculative.accepted_per_position):
            per_position.add_metric([str(position)], accepted)
        yield per_position


# structured outputs' counters: (metric name, GrammarCounters field, help)
_GRAMMAR_COUNTERS = (
    ("grammars_compiled", "compiles", "Structured-output grammars compiled (a distinct constraint not cached)."),
    ("grammar_cache_hits", "cache_hits", "Structured-output grammars found compiled."),
    ("compile_seconds", "compile_seconds", "Seconds compiling structured-output grammars."),
    ("mask_fills", "mask_fills", "Steps whose grammar masks the host filled (one per step with a constrained row)."),
    ("masked_rows", "masked_rows", "Constrained rows whose grammar mask the host filled."),
    ("mask_seconds", "mask_seconds", "Host seconds filling grammar masks."),
)

# speculative decoding's counters, each named spec_decode_<its SpecDecodeCounters field> as
# vLLM names them (draft_seconds is shiftjax's): (field, help)
_SPEC_DECODE_COUNTERS = (
    ("num_drafts", "Drafts verified (one per request per step that verified a draft)."),
    ("num_draft_tokens", "Draft tokens verified."),
    ("num_accepted_tokens", "Draft tokens accepted."),
    ("draft_seconds", "Host seconds proposing drafts."),
)


def start_metrics_server(metrics: Metrics, port: int, host: str = "127.0.0.1"):
    """Serves ``metrics`` as Prometheus text on ``http://host:port/metrics`` from a daemon
    thread, and 404 on any other path (prometheus_client's own server answered every path);
    returns ``(server, thread)``: ``server.shutdown()`` stops it. Port 0 picks a free port,
    read back from ``server.server_port``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a scraper that sends half a request is not waited on for ever

        def do_GET(self):
            if self.path.partition("?")[0] != "/metrics":
                self._answer(404, b"not found: this port serves /metrics only\n", "text/plain; charset=utf-8")
            else:
                self._answer(200, metrics.render(), CONTENT_TYPE_LATEST)

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            log.debug("metrics %s: " + format, self.client_address[0], *args)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="shiftjax-metrics", daemon=True)
    thread.start()
    return server, thread
