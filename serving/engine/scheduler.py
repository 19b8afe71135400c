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

Speculative decoding (``speculative.py``): in a step scheduled while at most
``disable_by_batch_size`` requests run, a decoding request whose last token the host
knows asks the drafter for up to ``num_speculative_tokens`` more; the draft takes rows the
step's sequence limit leaves after every running and waiting request has one, and tokens
of the budget. The commit keeps the accepted prefix and the token sampled after it, and
the request's computed length rolls back to them: the K/V written for the rejected rest is
overwritten by later steps.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

import numpy as np

from shiftjax.batch import SAMPLING_FIELDS, StepBatch, empty_batch
from shiftjax.cache import pages_for
from shiftjax.serving.engine.admission import check_admission
from shiftjax.serving.engine.page_allocator import OutOfPages, PageAllocator
from shiftjax.serving.engine.prefix_cache import PrefixCache, cache_key
from shiftjax.serving.engine.request import Request, ScheduledStep
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.speculative import Drafter, SpecDecodeTally, SpeculativeConfig, accepted_length

__all__ = ["QueueFull", "Request", "ScheduledStep", "Scheduler", "SchedulerConfig"]


class QueueFull(Exception):
    """The admission queue is at its bound; the caller answers RESOURCE_EXHAUSTED."""


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


class Scheduler:
    """``speculative``: draft for decoding requests (its drafter is made here)."""

    def __init__(self, config: SchedulerConfig, speculative: SpeculativeConfig | None = None):
        self.config = config
        self.speculative = speculative
        self.drafter: Drafter | None = None if speculative is None else speculative.make_drafter()
        self.spec_tally = SpecDecodeTally(0 if speculative is None else speculative.num_speculative_tokens)
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
        self._ended(request)
        if request in self.waiting:
            self.waiting.remove(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def would_speculate(self) -> bool:
        """Whether a step scheduled now may draft: speculation is on, the running requests are
        not above ``disable_by_batch_size``, and one of them could take a draft if the step
        before it were committed (the engine then schedules after that commit)."""
        spec = self.speculative
        if spec is None or (spec.disable_by_batch_size is not None
                            and len(self.running) > spec.disable_by_batch_size):
            return False
        return any(not r.params.disable_speculation and r.grammar is None for r in self.running)

    def schedule(self) -> ScheduledStep | None:
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []
        drafts: dict[int, list[int]] = {}  # id(request) -> its draft
        self._chunks = chunks  # requests already in this step are never preempted
        # rows a draft may take: those the step's sequence limit leaves once every running and
        # waiting request has one (a draft never delays an admission)
        spare_rows = self.config.max_num_seqs - len(self.running) - len(self.waiting)
        speculating = self.would_speculate and spare_rows > 0
        # Decodes first (each needs one token), oldest first; preempt the newest on shortage.
        for request in list(self.running):
            if request not in self.running or not request.wants_decode:
                continue
            if budget == 0:
                break
            draft = []
            if speculating and spare_rows > 0 and budget > 1 and request.may_speculate:
                room = min(self.speculative.num_speculative_tokens, spare_rows, budget - 1,
                           request.params.max_tokens - len(request.output_ids) - 1)
                if room > 0:
                    started = time.perf_counter()
                    draft = self.drafter.propose(request, room)[:room]
                    self.spec_tally.draft_seconds += time.perf_counter() - started
            if draft and not self._reserve(request, 1 + len(draft), preempt=False):
                draft = []  # a draft never preempts a request
            if not self._reserve(request, 1 + len(draft)):
                continue
            chunks.append((request, 1 + len(draft)))
            if draft:
                drafts[id(request)] = draft
                spare_rows -= len(draft)
            budget -= 1 + len(draft)
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
        return self._build(chunks, drafts)

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

    def _ended(self, request: Request) -> None:
        if self.drafter is not None:
            self.drafter.finish(request)

    def _release(self, request: Request) -> None:
        self.allocator.free(request.pages)
        request.pages = []
        request.num_registered = 0
        request._page_array = None
        if request in self.running:
            self.running.remove(request)

    def _build(self, chunks: list[tuple[Request, int]], drafts: dict[int, list[int]] | None = None
               ) -> ScheduledStep:
        """The step's host batch. Per request only Python scalars and lists are gathered;
        the arrays are filled with a few whole-array operations (per-request numpy work cost
        ~8 us a request: 0.57 ms for 64 decoding sequences, on a 2-core CPU;
        benchmarks/README.md, "CPU")."""
        page_size = self.config.page_size
        # A request with pending tokens decodes the latest; the device takes them from one result.
        sources = {request.pending_source[0] for request, _ in chunks if request.num_pending}
        if len(sources) > 1:
            raise RuntimeError(f"a step would take sampled tokens from steps {sorted(sources)}: "
                               "schedule at most one step ahead of the last commit")
        requests = [request for request, _ in chunks]
        step_drafts = [(drafts or {}).get(id(request), []) for request in requests]
        # What the whole-array fill below relies on (every schedule() path keeps both): a
        # chunk of no tokens would shift every later row's tokens, a request twice in one
        # step would be given two sequence rows over the same pages. A raise is a bug in
        # schedule(), which has reserved the step's pages by now.
        if len(chunks) and min(size for _, size in chunks) < 1:
            raise RuntimeError(f"a step's chunk has {min(size for _, size in chunks)} tokens; each must have at least one")
        if len({id(request) for request in requests}) != len(requests):
            raise RuntimeError("a request appears twice in one step")
        step_id = next(self._step_ids)
        # rows: one per request, or 1 + k of one token each for a request with a draft of k
        rows_of = [1 + len(draft) if draft else 1 for draft in step_drafts]
        row_request = np.repeat(np.arange(len(chunks)), rows_of)
        first_row = np.cumsum(rows_of) - rows_of
        firsts = np.array([request.num_scheduled for request in requests], np.int64)
        row_sizes = np.array([1 if draft else size for (_, size), draft in zip(chunks, step_drafts)], np.int64)
        row_firsts = firsts[row_request] + np.arange(len(row_request)) - first_row[row_request]
        row_sizes = row_sizes[row_request]
        num_tokens, num_rows = int(row_sizes.sum()), len(row_request)
        batch = empty_batch(num_tokens, num_rows, self.config.max_pages_per_seq)
        ends = np.cumsum(row_sizes)
        batch.query_start[1:] = ends
        batch.seq_lens[:] = row_firsts + row_sizes
        if num_tokens == num_rows:  # one token a row: token i is row i's next position
            row, positions = np.arange(num_tokens), row_firsts
        else:  # token i belongs to row[i], at row_firsts[row] + (i - its row's start)
            row = np.repeat(np.arange(num_rows), row_sizes)
            positions = row_firsts[row] + np.arange(num_tokens) - (ends - row_sizes)[row]
        batch.positions[:] = positions
        page_arrays = [requests[j].page_array() for j in row_request]
        num_pages = np.array([len(pages) for pages in page_arrays])
        # row b's pages at flat offsets b * max_pages + 0..len-1 (cost in real pages, not rows x max_pages)
        starts = np.repeat(np.arange(num_rows) * batch.page_table.shape[1] - (np.cumsum(num_pages) - num_pages),
                           num_pages)
        batch.page_table.reshape(-1)[starts + np.arange(int(num_pages.sum()))] = np.concatenate(page_arrays)
        batch.slot_mapping[:] = batch.page_table[row, positions // page_size] * page_size + positions % page_size
        token_ids, token_source = [], np.full(num_tokens, -1, np.int32)
        samples, sampled_rows, sampled_params = [], [], []
        constrained, masks_wait = [], False
        for b, ((request, size), draft) in enumerate(zip(chunks, step_drafts)):
            first, last_row = int(firsts[b]), int(first_row[b]) + rows_of[b] - 1
            known = request.token_slice(first, size - len(draft)) + draft
            token_ids += known
            decodes_pending = len(known) < size
            if decodes_pending:  # a decode of the token the uncommitted step samples
                token_ids += [0] * (size - len(known))
                token_source[int(ends[last_row]) - 1] = request.pending_source[1]
            reaches_end = first + size - len(draft) == request.num_tokens + request.num_pending
            samples.append(reaches_end)
            if reaches_end:
                if request.grammar is not None:
                    constrained.append(b)
                    masks_wait = masks_wait or decodes_pending
                sampled_rows += range(int(first_row[b]), last_row + 1)
                sampled_params += [request.params] * rows_of[b]
                request.num_pending += 1
                request.pending_source = (step_id, int(first_row[b]))
            request.num_in_flight += size
        batch.token_ids[:] = token_ids
        if sampled_rows:
            sampled_rows = np.array(sampled_rows)
            batch.sample_index[sampled_rows] = ends[sampled_rows] - 1
            for name in SAMPLING_FIELDS:
                getattr(batch, name)[sampled_rows] = [getattr(params, name) for params in sampled_params]
        speculative = any(step_drafts)
        return ScheduledStep(batch, num_tokens, requests, samples, step_id=step_id,
                             token_source=token_source, source_step=next(iter(sources), None),
                             preemptions=[r.preemptions for r in requests], constrained=constrained,
                             masks_wait=masks_wait, first_row=first_row.tolist() if speculative else None,
                             drafts=step_drafts if speculative else None)

    def commit(self, step: ScheduledStep, tokens, logprobs, mode: str, top_ids=None, top_logprobs=None
               ) -> list[Request]:
        """Records a step's results (per row of its batch); returns the requests that
        finished with it.

        Steps are committed in the order they were scheduled. A request that finished
        (aborted, or its end came in an earlier step) or was preempted since the step was
        scheduled takes nothing from it; ``step.delivered`` says who took a token (or
        tokens: a verified draft gives its accepted prefix and the token sampled after it).
        ``top_ids``/``top_logprobs`` (``[rows, K]``, most likely first) give the alternatives
        of the requests that asked for ``top_logprobs``."""
        finished = []
        step.delivered = [False] * len(step.requests)
        for b, request in enumerate(step.requests):
            if request.finished or request.preemptions != step.preemptions[b]:
                continue
            row = step.row_of(b)
            size = int(step.batch.query_start[row + 1] - step.batch.query_start[row])
            draft = step.drafts[b] if step.drafts is not None else []
            request.num_in_flight -= (size + len(draft)) if draft else size
            request.modes.append(mode)
            if not step.samples[b]:
                request.num_computed += size
                self.prefix_cache.register(request)
                continue
            request.num_pending -= 1
            if request.num_pending == 0:
                request.pending_source = None
            step.delivered[b] = True
            if not draft:
                request.num_computed += size
                self._deliver(request, int(tokens[row]), float(logprobs[row]), _row(top_ids, row), _row(top_logprobs, row))
            else:
                kept = accepted_length(draft, [int(t) for t in tokens[row:row + 1 + len(draft)]])
                self.spec_tally.count(len(draft), kept)
                # the K/V of its last token and of each kept draft token are the request's; the
                # rest rolls back (later steps overwrite it)
                for r in range(row, row + 1 + kept):
                    request.num_computed += 1
                    if self._deliver(request, int(tokens[r]), float(logprobs[r]), _row(top_ids, r),
                                     _row(top_logprobs, r)):
                        break
            self.prefix_cache.register(request)
            if request.finished:
                self._release(request)
                self._ended(request)
                finished.append(request)
        return finished

    @staticmethod
    def _deliver(request: Request, token: int, logprob: float, top_ids, top_logprobs) -> bool:
        """Appends one sampled token to ``request``; whether it ends the request."""
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        wanted = request.params.top_logprobs
        if wanted and top_ids is not None:
            request.output_top_logprobs.append(tuple(zip(top_ids[:wanted].tolist(), top_logprobs[:wanted].tolist())))
        if token in request.eos_token_ids or token in request.params.stop_token_ids:
            # an errored grammar allows only the end: that is no complete output
            request.finish_reason = "error" if request.grammar is not None and request.grammar.failed else "stop"
        elif request.grammar is not None and not request.grammar.accept(token):
            request.finish_reason = "error"  # a token its mask forbids: a bug, not the client's
        elif request.grammar is not None and request.grammar.terminated:
            request.finish_reason = "stop"  # the grammar is complete and allows nothing more
        elif len(request.output_ids) >= request.params.max_tokens:
            request.finish_reason = "length"
        return request.finished


def _row(array, row: int):
    return None if array is None else array[row]
