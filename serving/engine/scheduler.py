"""A step scheduler in the manner of vLLM V1: a token budget, decodes first, chunked prefill.

Each step packs decode tokens of running requests first, then prefill chunks of running
and waiting requests until the token budget or the sequence limit is reached. A request
whose next token needs a page when none is free preempts the most recently admitted
request, which returns to the head of the queue and later recomputes its tokens.

A step may be scheduled before the previous one is committed (asynchronous scheduling:
the host prepares step N+1 while the devices run N). A request that samples in the
uncommitted step then decodes its next position with a token the host does not know yet:
``ScheduledStep.token_source`` names the row of that step's result to take it from, on
the device. Committing a step that a preemption or an abort overtook changes nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from shiftjax.batch import SAMPLING_FIELDS, StepBatch, empty_batch
from shiftjax.cache import pages_for
from shiftjax.serving.engine.admission import check_admission
from shiftjax.serving.engine.page_allocator import OutOfPages, PageAllocator
from shiftjax.serving.engine.prefix_cache import PrefixCache, cache_key
from shiftjax.serving.engine.sampling_params import SamplingParams


class QueueFull(Exception):
    """The admission queue is at its bound; the caller answers RESOURCE_EXHAUSTED."""


@dataclasses.dataclass(eq=False)  # identity, not field-by-field comparison, in queues
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    # per output token, when params.top_logprobs: ((token id, logprob), ...) most likely first
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache (committed steps)
    num_in_flight: int = 0  # tokens of scheduled steps not yet committed
    num_pending: int = 0  # tokens sampled by uncommitted steps, not yet in output_ids
    pending_source: tuple[int, int] | None = None  # (step id, row) of the latest such token
    finish_reason: str | None = None
    modes: list[str] = dataclasses.field(default_factory=list)  # mode of every step it ran in
    preemptions: int = 0
    # prefix caching (prefix_cache.py): the hash key of its cache salt, the block hashes of
    # its full pages so far, how many of its pages are named, whether its first admission
    # looked the cache up, and the prompt tokens that lookup found cached
    cache_key: bytes = b""
    block_hashes: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    num_registered: int = 0
    prefix_checked: bool = False
    num_cached_tokens: int = 0
    # structured outputs (grammar.py): its place in its grammar, advanced by every commit
    grammar: object | None = dataclasses.field(default=None, repr=False)
    _page_array: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def page_array(self) -> np.ndarray:
        """``pages`` as int32, converted again only when pages were added (the scheduler
        clears it when it frees them)."""
        if self._page_array is None or len(self._page_array) != len(self.pages):
            self._page_array = np.asarray(self.pages, np.int32)
        return self._page_array

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, first: int, size: int) -> list[int]:
        """``tokens[first:first + size]`` without building the whole list."""
        prompt = len(self.prompt_ids)
        head = self.prompt_ids[first:first + size]
        return head + self.output_ids[max(first - prompt, 0):max(first + size - prompt, 0)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_scheduled(self) -> int:
        """Tokens whose K/V are in the cache or on their way there: where the next chunk starts."""
        return self.num_computed + self.num_in_flight

    @property
    def ends_in_flight(self) -> bool:
        """A step in flight samples its last token (max_tokens): it ends at that commit."""
        return self.num_pending > 0 and len(self.output_ids) + self.num_pending >= self.params.max_tokens

    @property
    def wants_decode(self) -> bool:
        """Every token it has (pending ones included) but the last is scheduled, and it may
        still grow: its next step is one decode token."""
        return (self.num_scheduled == self.num_tokens + self.num_pending - 1
                and len(self.output_ids) + self.num_pending < self.params.max_tokens)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    page_size: int
    num_pages: int
    max_queue: int = 1024
    enable_prefix_caching: bool = False  # share full prompt pages across requests (prefix_cache.py)
    # admission's limits on a request (admission.py); None: not checked
    vocab_size: int | None = None
    max_top_logprobs: int | None = None  # alternatives a step returns per token

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "page_size", "max_queue"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.num_pages < 2:
            raise ValueError("num_pages must be at least 2 (page 0 is scratch)")

    @property
    def max_pages_per_seq(self) -> int:
        return pages_for(self.max_model_len, self.page_size)


@dataclasses.dataclass
class ScheduledStep:
    """What one step computes: host arrays (unpadded sizes) and who gets a sampled token.

    ``token_source[i]`` is -1 where ``batch.token_ids[i]`` is known, else the row of step
    ``source_step``'s result whose sampled token goes there (that step was scheduled
    just before this one and is not yet committed)."""

    batch: StepBatch
    num_tokens: int
    requests: list[Request]
    samples: list[bool]  # per request: is a token sampled for it this step
    step_id: int = 0
    token_source: np.ndarray | None = None  # [num_tokens] int32
    source_step: int | None = None
    preemptions: list[int] = dataclasses.field(default_factory=list)  # per request, when scheduled
    delivered: list[bool] = dataclasses.field(default_factory=list)  # per request, set by commit
    # rows that sample under a grammar, and whether one of them decodes a token of
    # ``source_step``: its mask then needs that step committed first (core.py)
    constrained: list[int] = dataclasses.field(default_factory=list)
    masks_wait: bool = False

    @property
    def takes_sampled_tokens(self) -> bool:
        return self.source_step is not None


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.allocator = PageAllocator(config.num_pages, caching=config.enable_prefix_caching)
        self.prefix_cache = PrefixCache(self.allocator, config.page_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._chunks: list[tuple[Request, int]] = []
        self._step_ids = itertools.count()
        self.num_preemptions = 0

    def add(self, prompt_ids: list[int], params: SamplingParams, eos_token_ids=(),
            cache_salt: str | None = None, grammar=None) -> Request:
        """Queues a request; :class:`InvalidRequest` for one that breaks an admission rule
        (admission.check_admission), :class:`QueueFull` when the queue is at its bound.
        ``grammar``: its :class:`~shiftjax.serving.engine.grammar.GrammarState`, if constrained."""
        check_admission(prompt_ids, params, self.config)
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFull(f"admission queue is full ({self.config.max_queue} requests)")
        request = Request(next(self._ids), list(prompt_ids), params,
                          () if params.ignore_eos else tuple(eos_token_ids), cache_key=cache_key(cache_salt),
                          grammar=grammar)
        self.waiting.append(request)
        return request

    def abort(self, request: Request, reason: str = "aborted") -> None:
        """Ends a request and frees its pages at once (client gone, deadline passed, a stop
        string matched: ``reason`` is its finish reason unless it already had one)."""
        request.finish_reason = request.finish_reason or reason
        self._release(request)
        if request in self.waiting:
            self.waiting.remove(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []
        self._chunks = chunks  # requests already in this step are never preempted
        # Decodes first (each needs one token), oldest first; preempt the newest on shortage.
        for request in list(self.running):
            if request not in self.running or not request.wants_decode:
                continue
            if budget == 0:
                break
            if not self._reserve(request, 1):
                continue
            chunks.append((request, 1))
            budget -= 1
        # Then prefill: running requests mid-prompt, then admissions from the queue.
        candidates = [r for r in self.running if r.num_scheduled < r.num_tokens - 1]
        for request in candidates:
            if budget == 0:
                break
            if request not in self.running:  # preempted for an earlier candidate's pages
                continue
            size = min(request.num_tokens - request.num_scheduled, budget)
            if self._reserve(request, size):
                chunks.append((request, size))
                budget -= size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            self.prefix_cache.take(request)
            size = min(request.num_tokens - request.num_scheduled, budget)
            if not self._reserve(request, size, preempt=False):
                self.prefix_cache.give_back(request)
                break
            self.waiting.popleft()
            self.prefix_cache.admitted(request)
            self.running.append(request)
            chunks.append((request, size))
            budget -= size
        if not chunks:
            return None
        return self._build(chunks)

    def _reserve(self, request: Request, new_tokens: int, preempt: bool = True) -> bool:
        """Makes sure the pages for ``new_tokens`` more tokens exist, preempting if allowed."""
        needed = pages_for(request.num_scheduled + new_tokens, self.config.page_size) - len(request.pages)
        while needed > 0:
            try:
                request.pages += self.allocator.allocate(needed)
                return True
            except OutOfPages:
                # Not a request whose step in flight samples its last token: it frees its pages
                # at that commit, and preempting it would throw that token away, which with two
                # such requests taking turns never ends (async scheduling).
                victims = [r for r in self.running
                           if r is not request and all(r is not c for c, _ in self._chunks)
                           and not r.ends_in_flight]
                if not preempt or not victims:
                    return False
                self._preempt(victims[-1])
        return True

    def forget(self, step: ScheduledStep) -> None:
        """A scheduled step that will never be committed (it failed to launch): its requests
        that are still running go back to the queue, to recompute from what was committed."""
        for b, request in enumerate(step.requests):
            if request in self.running and request.preemptions == step.preemptions[b]:
                self._preempt(request)

    def preempt_all(self, caches_lost: bool = False) -> None:
        """Returns every running request to the queue to recompute; with ``caches_lost``
        (the caches were reallocated) the prefix cache forgets every page too."""
        for request in reversed(list(self.running)):
            self._preempt(request)
        if caches_lost:
            self.prefix_cache.forget()

    def _preempt(self, request: Request) -> None:
        """Back to the queue with nothing cached. Tokens of uncommitted steps are forgotten
        (their commit sees the preemption count changed); a recompute samples them again,
        with the same keys (sampling.py), so the request generates what it would have."""
        request.preemptions += 1
        self.num_preemptions += 1
        self._release(request)
        request.num_computed = request.num_in_flight = request.num_pending = 0
        request.pending_source = None
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.allocator.free(request.pages)
        request.pages = []
        request.num_registered = 0
        request._page_array = None
        if request in self.running:
            self.running.remove(request)

    def _build(self, chunks: list[tuple[Request, int]]) -> ScheduledStep:
        """The step's host batch. Per request only Python scalars and lists are gathered;
        the arrays are filled with a few whole-array operations (per-request numpy work cost
        ~8 us a request: 0.57 ms for 64 decoding sequences, benchmarks/scheduler_host.py)."""
        page_size = self.config.page_size
        # A request with pending tokens decodes the latest; the device takes them from one result.
        sources = {request.pending_source[0] for request, _ in chunks if request.num_pending}
        if len(sources) > 1:
            raise RuntimeError(f"a step would take sampled tokens from steps {sorted(sources)}: "
                               "schedule at most one step ahead of the last commit")
        requests = [request for request, _ in chunks]
        sizes = np.array([size for _, size in chunks], np.int64)
        # What the whole-array fill below relies on (every schedule() path keeps both): a
        # chunk of no tokens would shift every later row's tokens, a request twice in one
        # step would be given two sequence rows over the same pages. A raise is a bug in
        # schedule(), which has reserved the step's pages by now.
        if len(chunks) and int(sizes.min()) < 1:
            raise RuntimeError(f"a step's chunk has {int(sizes.min())} tokens; each must have at least one")
        if len({id(request) for request in requests}) != len(requests):
            raise RuntimeError("a request appears twice in one step")
        step_id = next(self._step_ids)
        firsts = np.array([request.num_scheduled for request in requests], np.int64)
        num_tokens = int(sizes.sum())
        batch = empty_batch(num_tokens, len(chunks), self.config.max_pages_per_seq)
        ends = np.cumsum(sizes)
        batch.query_start[1:] = ends
        batch.seq_lens[:] = firsts + sizes
        if num_tokens == len(chunks):  # decodes only: token i is sequence i's next position
            row, positions = np.arange(num_tokens), firsts
        else:  # token i belongs to sequence row[i], at firsts[row] + (i - its chunk's start)
            row = np.repeat(np.arange(len(chunks)), sizes)
            positions = firsts[row] + np.arange(num_tokens) - (ends - sizes)[row]
        batch.positions[:] = positions
        page_arrays = [request.page_array() for request in requests]
        num_pages = np.array([len(pages) for pages in page_arrays])
        # row b's pages at flat offsets b * max_pages + 0..len-1 (cost in real pages, not rows x max_pages)
        starts = np.repeat(np.arange(len(chunks)) * batch.page_table.shape[1] - (np.cumsum(num_pages) - num_pages),
                           num_pages)
        batch.page_table.reshape(-1)[starts + np.arange(int(num_pages.sum()))] = np.concatenate(page_arrays)
        batch.slot_mapping[:] = batch.page_table[row, positions // page_size] * page_size + positions % page_size
        token_ids, token_source = [], np.full(num_tokens, -1, np.int32)
        samples, sampled_rows, sampled_params = [], [], []
        constrained, masks_wait = [], False
        for b, (request, size) in enumerate(chunks):
            first = int(firsts[b])
            known = request.token_slice(first, size)
            token_ids += known
            decodes_pending = len(known) < size
            if decodes_pending:  # a decode of the token the uncommitted step samples
                token_ids += [0] * (size - len(known))
                token_source[int(ends[b]) - 1] = request.pending_source[1]
            reaches_end = first + size == request.num_tokens + request.num_pending
            samples.append(reaches_end)
            if reaches_end:
                if request.grammar is not None:
                    constrained.append(b)
                    masks_wait = masks_wait or decodes_pending
                sampled_rows.append(b)
                sampled_params.append(request.params)
                request.num_pending += 1
                request.pending_source = (step_id, b)
            request.num_in_flight += size
        batch.token_ids[:] = token_ids
        if sampled_rows:
            sampled_rows = np.array(sampled_rows)
            batch.sample_index[sampled_rows] = ends[sampled_rows] - 1
            for name in SAMPLING_FIELDS:
                getattr(batch, name)[sampled_rows] = [getattr(params, name) for params in sampled_params]
        return ScheduledStep(batch, num_tokens, requests, samples, step_id=step_id,
                             token_source=token_source, source_step=next(iter(sources), None),
                             preemptions=[r.preemptions for r in requests], constrained=constrained,
                             masks_wait=masks_wait)

    def commit(self, step: ScheduledStep, tokens, logprobs, mode: str, top_ids=None, top_logprobs=None
               ) -> list[Request]:
        """Records a step's results; returns the requests that finished with it.

        Steps are committed in the order they were scheduled. A request that finished
        (aborted, or its end came in an earlier step) or was preempted since the step was
        scheduled takes nothing from it; ``step.delivered`` says who took a token.
        ``top_ids``/``top_logprobs`` (``[seqs, K]``, most likely first) give the alternatives
        of the requests that asked for ``top_logprobs``."""
        finished = []
        step.delivered = [False] * len(step.requests)
        for b, request in enumerate(step.requests):
            if request.finished or request.preemptions != step.preemptions[b]:
                continue
            size = int(step.batch.query_start[b + 1] - step.batch.query_start[b])
            request.num_computed += size
            request.num_in_flight -= size
            request.modes.append(mode)
            self.prefix_cache.register(request)
            if not step.samples[b]:
                continue
            request.num_pending -= 1
            if request.num_pending == 0:
                request.pending_source = None
            step.delivered[b] = True
            token = int(tokens[b])
            request.output_ids.append(token)
            request.output_logprobs.append(float(logprobs[b]))
            wanted = request.params.top_logprobs
            if wanted and top_ids is not None:
                request.output_top_logprobs.append(
                    tuple(zip(top_ids[b, :wanted].tolist(), top_logprobs[b, :wanted].tolist())))
            if token in request.eos_token_ids or token in request.params.stop_token_ids:
                # an errored grammar allows only the end: that is no complete output
                request.finish_reason = "error" if request.grammar is not None and request.grammar.failed else "stop"
            elif request.grammar is not None and not request.grammar.accept(token):
                request.finish_reason = "error"  # a token its mask forbids: a bug, not the client's
            elif request.grammar is not None and request.grammar.terminated:
                request.finish_reason = "stop"  # the grammar is complete and allows nothing more
            elif len(request.output_ids) >= request.params.max_tokens:
                request.finish_reason = "length"
            if request.finished:
                self._release(request)
                finished.append(request)
        return finished
