"""The engine service's contract: what a front end submits and what streams back.

Both front ends (gRPC in ``grpc_server.py``, OpenAI-compatible HTTP in ``http_server.py``)
are thin adapters over one object satisfying :class:`EngineService`; neither knows about
modes, buckets or pages. Errors a caller can act on are exceptions defined here, so each
front end maps them to its own status codes in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

from shiftjax.serving.engine.admission import checked_prompt_ids
from shiftjax.serving.engine.errors import DeadlineExceeded, InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.engine.output_processor import FINISH_LENGTH, FINISH_STOP
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.stats import EngineSnapshot

__all__ = ["DeadlineExceeded", "InvalidRequest", "Overloaded", "RequestFailed", "Unavailable",  # re-exported
           "FINISH_LENGTH", "FINISH_STOP", "prompt_ids_or_error"]

# ``ids`` as a tuple, or InvalidRequest naming the field (default ``prompt_ids``): the
# admission rule for a prompt, which the front ends apply to the prompts they tokenize.
prompt_ids_or_error = checked_prompt_ids

# Finish reasons: the engine's (output_processor.py: FINISH_STOP, FINISH_LENGTH, as the
# OpenAI API and vLLM spell them), plus those a server needs. AsyncEngineService ends no
# stream with the last two (it raises RequestFailed or DeadlineExceeded); its observer, and
# so the metrics, still hear them by name.
FINISH_ABORT = "abort"  # cancelled, client gone, server shutting down
FINISH_ERROR = "error"  # an internal error failed this request alone
FINISH_DEADLINE = "deadline"  # the request's deadline passed first
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR, FINISH_DEADLINE)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One prompt, already tokenized, and how to continue it.

    ``deadline`` is a ``time.monotonic()`` instant after which the service ends the request,
    frees its pages and raises :class:`DeadlineExceeded` from its stream; ``None`` means no
    deadline. ``cache_salt`` (vLLM's): the request shares cached prompt pages only with
    requests of the same salt; ``None`` is the shared cache (``validation.checked_cache_salt``
    says what a salt may be).
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str | None = None  # None: the service assigns a random one (request_ids.py says what a given one may be)
    deadline: float | None = None
    cache_salt: str | None = None
    # params.structured_outputs compiled (check_structured_outputs, on a front end's worker
    # thread), so that the engine thread never compiles; None: compiled at admission
    grammar: object | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before temperature and
    filters, as vLLM reports it) and, when asked, the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    output_tokens: int
    queue_seconds: float  # submit to first scheduled step
    ttft_seconds: float  # submit to first token
    e2e_seconds: float  # submit to finish
    modes: tuple[str, ...]  # the mode of every step the request ran in
    preemptions: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one engine step added to one request's output.

    ``text`` is the new, complete UTF-8 text (bytes of a multi-byte character held back
    until it is whole; a stop string and what follows it never appear). The last delta of
    a stream has ``finish_reason`` and ``usage`` set; it may carry tokens too.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when params.logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    usage: Usage | None = None


@dataclasses.dataclass(frozen=True)
class ServiceStats:
    """A snapshot, read when asked (never cached): the numbers metrics and ServerInfo show.
    The engine's counters are its :class:`EngineSnapshot`, whole (summed over ``--dp``
    replicas; its ``waiting`` counts the requests submitted to the service and not yet taken
    by the engine thread too); the service adds what it alone knows."""

    engine: EngineSnapshot
    ready: bool
    draining: bool
    error: str | None = None  # why a started service stopped being ready (it needs a restart)


class EngineService(Protocol):
    """The engine as a service: submit, stream, cancel, inspect."""

    tokenizer: object  # shiftjax.checkpoints.tokenizer.Tokenizer

    def submit(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Validates and enqueues ``request`` at once (raising :class:`InvalidRequest`,
        :class:`Overloaded` or :class:`Unavailable` before anything streams), and returns
        the stream of its deltas. The stream raises :class:`DeadlineExceeded` when the
        request's deadline passes first, :class:`RequestFailed` when the engine fails it.
        Closing the stream early (``aclose()``, or the consuming task being cancelled)
        cancels the request and frees its pages; past the request's deadline, the deadline
        ends it instead (gRPC closes the stream at its deadline)."""
        ...

    def check_structured_outputs(self, params: SamplingParams):
        """``params.structured_outputs`` compiled (None without one), on the calling thread
        (a front end's worker), to send as ``GenerationRequest.grammar``; raises
        :class:`InvalidRequest` naming ``structured_outputs.<kind>`` for a constraint that
        does not compile."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Aborts a request; its stream ends with ``finish_reason == "abort"``, even when its
        deadline has passed unnoticed (the caller asked first). Returns whether the request
        was still live."""
        ...

    def stats(self) -> ServiceStats: ...

    def info(self) -> dict:
        """Model, config, mesh, modes, buckets, page pool, policy and its timing table,
        start-up compile figures: what ServerInfo and /v1/models report."""
        ...

    def step_trace(self) -> list[dict]:
        """The last steps, oldest first (ServerInfo's ``include_step_trace``): Unix ``time``
        at the step's end, ``mode``, ``num_tokens``, ``num_seqs``, ``running``, ``waiting``,
        ``seconds``; a data-parallel front adds each step's ``replica``."""
        ...


class EngineObserver(Protocol):
    """What the engine service reports as it runs (``metrics.Metrics`` implements it).

    Called on the engine thread; implementations must be cheap and thread-safe. Gauges
    (running, waiting, free pages) are not pushed here: a collector reads
    :meth:`EngineService.stats` at scrape time.
    """

    def on_startup(self, *, compile_seconds: float, executables: int, cache_hits: int) -> None: ...

    def on_step(self, *, mode: str, num_tokens: int, num_seqs: int, seconds: float, switched: bool) -> None: ...

    def on_token(self, *, first: bool, seconds_since_previous: float) -> None:
        """One streamed token: ``first`` gives TTFT (seconds since submit), else the ITL gap."""
        ...

    def on_preemption(self) -> None: ...

    def on_finish(self, *, usage: Usage, finish_reason: str) -> None:
        """Queue time, TTFT, TPOT and end-to-end latency, token counters, finish reasons
        (one of ``FINISH_REASONS``)."""
        ...
