"""What one benchmark run measured, summarised the way ``vllm bench serve`` does.

Definitions (vLLM's ``benchmarks/serve.py`` and ``endpoint_request_func.py``, so numbers
compare across servers):

- TTFT: send to the first streamed chunk that carries output.
- ITL: the gaps between consecutive output chunks of one request, pooled over all
  requests (one list, not a per-request mean).
- E2EL: send to the last output chunk.
- TPOT: ``(E2EL - TTFT) / (output_tokens - 1)`` per request, left out of the TPOT
  statistics when ``output_tokens <= 1`` (and counted as 0 against a TPOT SLO).
- throughput: completed requests, output tokens and input + output tokens, each divided
  by the run's wall-clock duration (first send to last completion).
- goodput: completed requests that meet every given SLO (``value <= slo``), per second.
- prefix-cache hit rate: prompt tokens whose K/V the server took from its prefix cache
  (its usage's ``cached_prompt_tokens`` / ``prompt_tokens_details.cached_tokens``) over
  prompt tokens, of completed requests.
- per turn (multi-turn chats): the TTFT statistics of each turn index apart, since a later
  turn's prompt is longer and, cached, cheaper.
- statistics in milliseconds: mean, median, std (population, numpy's default) and
  percentiles by ``numpy.percentile`` (linear interpolation); an empty list reads 0, as
  vLLM reports it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may name, in milliseconds
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; ``scheduled_at`` and
    ``sent_at`` are offsets from the start of the run (they differ when
    ``--max-concurrency`` held the request back)."""

    index: int
    prompt_len: int
    output_len: int  # what was asked for
    scheduled_at: float = 0.0
    sent_at: float = 0.0
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0  # as the server counted them (usage), else streamed tokens
    modes: list[str] = dataclasses.field(default_factory=list)  # per step, when the server says
    server_usage: dict = dataclasses.field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens the server's prefix cache had (0 when it says none)
    conversation: int | None = None  # a multi-turn chat's conversation and turn
    turn: int | None = None
    output_ids: list[int] | None = None  # kept when a later turn's prompt needs them

    @property
    def tpot(self) -> float | None:
        """``None`` when the request produced at most one token (no decode time to divide)."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO must be >= 0 ms")
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (vLLM counts TPOT as 0 for one token)."""
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] <= slo / 1000.0 for name, slo in slos_ms.items())


def latency_statistics(seconds: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean, median, std and ``p<q>`` of ``seconds``, in milliseconds (0 when empty)."""
    values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000.0
    stats = {
        "mean_ms": float(np.mean(values)),
        "median_ms": float(np.median(values)),
        "std_ms": float(np.std(values)),
    }
    for q in percentiles:
        stats[f"p{q:g}_ms"] = float(np.percentile(values, q))
    return stats


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    goodput_slos_ms: dict[str, float] | None = None,
    percentiles=DEFAULT_PERCENTILES,
) -> dict:
    """The run's summary: counts, throughputs, goodput and per-metric statistics."""
    if duration_s <= 0:
        raise ValueError(f"the run's duration must be > 0 s, got {duration_s}")
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2el for r in done],
    }
    summary = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": None,
        "goodput_slos_ms": dict(goodput_slos_ms or {}),
    }
    if goodput_slos_ms:
        summary["request_goodput"] = sum(meets_slos(r, goodput_slos_ms) for r in done) / duration_s
    for name in LATENCY_METRICS:
        summary[name] = latency_statistics(samples[name], percentiles)
    summary["mode_steps"] = count_modes(done)
    cached = sum(r.cached_tokens for r in done)
    summary["prefix_cache"] = {"cached_prompt_tokens": cached, "hit_rate": cached / total_input if total_input else 0.0}
    turns = sorted({r.turn for r in done if r.turn is not None})
    if turns:
        summary["ttft_by_turn"] = [latency_statistics([r.ttft for r in done if r.turn == turn], percentiles)
                                   for turn in range(turns[-1] + 1)]
    return summary


def count_modes(records: list[RequestRecord]) -> dict[str, int]:
    """Request-steps per mode, from the servers' usage (empty when it reports none)."""
    counts: dict[str, int] = {}
    for record in records:
        for mode in record.modes:
            counts[mode] = counts.get(mode, 0) + 1
    return counts


class StreamClock:
    """Times one streamed request into a :class:`RequestRecord` by vLLM's rules: the clock
    starts at send, the first chunk with output sets TTFT, each later one adds an ITL gap,
    and the last one sets E2EL (a trailing usage-only chunk moves nothing)."""

    def __init__(self, record: RequestRecord, clock):
        self.record = record
        self._clock = clock
        self._start = clock()
        self._latest = self._start
        self.streamed_tokens = 0

    def output_chunk(self, num_tokens: int = 1) -> None:
        now = self._clock()
        if self.streamed_tokens == 0:
            self.record.ttft = now - self._start
        else:
            self.record.itl.append(now - self._latest)
        self._latest = now
        self.streamed_tokens += num_tokens

    def finish(self, server_output_tokens: int | None = None) -> None:
        """Success needs at least one output chunk; the server's own token count wins over
        the streamed one when it gives one."""
        self.record.e2el = self._latest - self._start
        self.record.output_tokens = server_output_tokens if server_output_tokens else self.streamed_tokens
        if self.streamed_tokens == 0:
            self.record.success = False
            self.record.error = self.record.error or "the stream ended without any output, so TTFT is undefined"
        else:
            self.record.success = True
