"""The engine: scheduler, caches and compiled steps.

The engine holds a scheduler (what runs), a shift policy (in which mode) and a step runner
(the devices' state: weights, caches, executables, samplers; ``runner.py``); the start-up
phases that make them are ``builder.py``. ``Engine.step()`` runs one turn of the step
pipeline: it schedules a batch, picks its bucket and the policy's mode for that bucket
(:func:`bucket_and_mode`), has the runner pad, place and dispatch it with the caches
donated (the step packs greedy tokens; the samplers run only for a batch with a row that
samples or asks for alternatives), and commits the one small result array to the
requests. ``Engine.run_until_done`` loops over it for a script.

With ``async_scheduling`` (the default) the host schedules and dispatches step N+1 before
it waits for step N, so the host's share of a step (scheduling, padding, placing,
launching, committing) overlaps the devices' work instead of adding to it; a step then
costs about the larger of the two (benchmarks/README.md, "Two GPUs"). A request that
samples in step N decodes in N+1 with a token the host has not seen: N+1's executable
takes it from N's result on the devices before it runs the model (``token_fills.py``).

Structured outputs (``grammar.py``): a constrained row's allowed tokens are a bitmask the
sampler applies on the devices. Its mask for step N+1 needs its token of step N, which the
host does not have when it launches N+1 ahead of N's result. Such a step is launched
without its sampling: the devices run N+1's model while the host waits for N and commits
it (each grammar consumes its token); the masks are then filled on the mask thread while
the caller makes N's deltas, and N+1's sampler is launched at the start of the next turn,
before N+2 is scheduled, which reads its samples. The model's work still overlaps the
host's; the sampler's launch, and the fill where it outlasts the caller's work, are what a
constrained step adds (``StepCounters.mask_seconds``).

Speculative decoding (``speculative.py``): a draft must follow tokens the host knows, and a
request verifying one cannot be scheduled again until its commit says how much of the draft
was kept. A turn in which the scheduler may draft (``Scheduler.would_speculate``: few
enough requests run), or whose step in flight verifies a draft, therefore schedules after
the commit, as without ``async_scheduling``; above ``disable_by_batch_size`` running
requests the engine schedules ahead again, and so it does for a while after a turn that
tried and found nothing to draft (``speculative.DraftBackoff``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from shiftjax.serving.engine import builder
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.config import EngineConfig
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarState, MaskFiller, allow_all
from shiftjax.serving.engine.policy import ShiftPolicy
from shiftjax.serving.engine.prefix_cache import cache_key
from shiftjax.serving.engine.runner import LaunchedStep
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import Request, ScheduledStep, SchedulerConfig
from shiftjax.serving.engine.speculative import DraftBackoff
from shiftjax.serving.engine.stats import EngineSnapshot, GrammarCounters, StepCounters
from shiftjax.step_options import StepOptions
from shiftjax.weights import ModelWeights

__all__ = ["Engine", "EngineConfig", "LaunchedStep", "PipelineTurn", "StepFailed", "StepReport", "bucket_and_mode"]


def bucket_and_mode(scheduled: ScheduledStep, ladder: BucketLadder, policy: ShiftPolicy) -> tuple[tuple[int, int], str]:
    """The ``(tokens, seqs)`` bucket a scheduled step runs in (the smallest that holds its
    tokens and its sequence rows, a drafted request's rows each counted) and the mode the
    policy picks for it. The engine's choice, and the simulator's (``bench/simulate.py``)."""
    bucket = ladder.pick(scheduled.num_tokens, scheduled.num_rows)
    return bucket, policy.choose(*bucket)


class StepFailed(RuntimeError):
    """A step raised; ``requests`` are the ones it had scheduled (the caller fails them)."""

    def __init__(self, requests: list[Request]):
        super().__init__(f"a step of {len(requests)} requests failed")
        self.requests = requests


@dataclasses.dataclass(frozen=True)
class PipelineTurn:
    """What one :meth:`Engine.step` did: the steps it launched (two in a turn that found
    none in flight), the step it finished (None when that step's result failed), and the
    launches or results that failed (their requests are the caller's to fail)."""

    launched: tuple[LaunchedStep, ...]
    finished: StepReport | None
    failed: tuple[StepFailed, ...] = ()

    def result(self) -> StepReport:
        """The step this turn finished, or the turn's first failure raised (:class:`StepFailed`,
        naming the requests the failed step had scheduled; the caller fails them; the
        requests of a second failure in the same turn were preempted and recompute)."""
        if self.failed:
            raise self.failed[0]
        return self.finished


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one finished step did, for the service and its observer."""

    mode: str
    num_tokens: int  # scheduled tokens (before padding)
    bucket: tuple[int, int]  # (tokens, seqs) of the executable that ran
    requests: list[Request]  # the scheduled requests, in batch order
    sampled: list[bool]  # per request: did it get a token (not if it ended or was preempted first)
    finished: list[Request]
    switched: bool
    # wall time of the step, host work included: from its launch, or from the previous
    # step's end where the two overlapped, to its result on the host
    seconds: float


class Engine:
    """``report(message)``, if given, receives start-up progress lines (page pool, compiles).
    ``grammar_compiler`` compiles requests' structured outputs (none: such requests are
    refused). ``adjust_steps``: a benchmark's variant of the steps (``builder.build``)."""

    def __init__(self, weights: ModelWeights, config: EngineConfig, eos_token_ids=(),
                 report: Callable[[str], None] | None = None, *,
                 grammar_compiler: GrammarCompiler | None = None,
                 adjust_steps: Callable[[StepOptions], StepOptions] | None = None):
        self.weights = weights
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar_compiler = grammar_compiler
        self._mask_filler = self._mask_thread = None
        if grammar_compiler is not None:
            self._mask_filler = MaskFiller()
            # one thread: a step's masks are filled while the caller makes the last step's deltas
            self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shiftjax-masks")
        parts = builder.build(weights, config, report or (lambda message: None), adjust_steps)
        self.modes = parts.modes
        self.step_options = parts.step_options
        self.page_pool = parts.page_pool
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.policy = parts.policy
        # seconds per start-up phase, for the log and ServerInfo
        self.startup_seconds = parts.startup_seconds
        self.counters = StepCounters(self.modes)
        self._in_flight: LaunchedStep | None = None  # launched by step, not yet finished
        self._last_finished = 0.0
        self._deferred_failure: StepFailed | None = None  # a deferred sampling's, for step to report
        self._deferred_masks: tuple[LaunchedStep, concurrent.futures.Future] | None = None
        self._draft_backoff = DraftBackoff()  # when to stop giving up async scheduling for drafts

    @property
    def executables(self):
        return self.runner.executables

    @property
    def samplers(self):
        return self.runner.samplers

    @property
    def caches(self):
        return self.runner.caches

    @property
    def all_reduce(self) -> str:
        return self.step_options.all_reduce

    @property
    def all_to_all(self) -> str:
        return self.step_options.all_to_all

    @property
    def compile_seconds(self) -> float:
        """Compile (or store load) time summed over executables; the wall time of start-up
        compiling is ``executables.wall_seconds`` (lowering included)."""
        return sum(self.executables.compile_seconds.values())

    @property
    def num_pages(self) -> int:
        return self.page_pool.num_pages

    @property
    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return self.scheduler.has_work

    @property
    def limits(self) -> SchedulerConfig:
        """The limits that run: ``max_num_batched_tokens`` and ``max_num_seqs`` as clamped to
        the bucket ladder, the page pool as sized (not as configured)."""
        return self.scheduler.config

    def snapshot(self) -> EngineSnapshot:
        scheduler, counters = self.scheduler, self.counters
        allocator, prefix = scheduler.allocator, scheduler.prefix_cache
        return EngineSnapshot(
            running=len(scheduler.running), waiting=len(scheduler.waiting), num_pages=self.num_pages - 1,
            free_pages=allocator.num_free, preemptions=scheduler.num_preemptions,
            steps=counters.steps, switches=counters.switches, tokens=counters.tokens,
            steps_by_mode=dict(counters.steps_by_mode), tokens_by_mode=dict(counters.tokens_by_mode),
            prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            cached_pages=allocator.num_cached, evicted_pages=allocator.num_evicted,
            grammar=GrammarCounters(
                mask_fills=counters.mask_fills, masked_rows=counters.masked_rows, mask_seconds=counters.mask_seconds,
                **({} if (compiler := self.grammar_compiler) is None else dict(
                    compiles=compiler.compiles, cache_hits=compiler.cache_hits,
                    compile_seconds=compiler.compile_seconds))),
            speculative=scheduler.spec_tally.frozen())

    def add_request(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
                    grammar: CompiledGrammar | None = None) -> Request:
        """Queues a request (``cache_salt``: it shares cached prompt pages only with requests
        of the same salt); :class:`InvalidRequest` for one that breaks an admission rule or
        whose structured outputs do not compile. ``grammar``: ``params.structured_outputs``
        compiled already (:meth:`compile_grammar`, on another thread: the service's front
        ends keep compiling off the step loop); else it is compiled here (or found cached)."""
        if self.asleep:
            raise RuntimeError("the engine is asleep (its KV cache is freed): wake it up first")
        state = None
        if params.structured_outputs is not None:
            if grammar is None:
                grammar = self.compile_grammar(params)
            elif grammar.spec != params.structured_outputs:
                raise ValueError("the compiled grammar given is not the request's structured_outputs")
            state = GrammarState(grammar)
        return self.scheduler.add(prompt_ids, params, self.eos_token_ids, cache_salt, state)

    def replace_weights(self, weights: ModelWeights) -> None:
        """Serves ``weights`` from the next step. They must be laid out as the weights served
        now (model, mesh, storage, quantization, and every array's shape, dtype and sharding),
        so each compiled step takes them as it took the old ones: nothing is compiled. Refused
        while requests are queued or running; the prefix cache is dropped (its pages hold K/V
        the old weights computed)."""
        self.refuse_while_busy("replacing the weights")
        old = self.weights
        for name in ("config", "layout", "mesh", "storage", "quantization"):
            if getattr(weights, name) != getattr(old, name):
                raise ValueError(f"the new weights' {name} differs from the served weights'")
        for (path, new_leaf), old_leaf in zip(jax.tree_util.tree_leaves_with_path((weights.tp, weights.sp)),
                                              jax.tree.leaves((old.tp, old.sp))):
            if ((new_leaf.shape, new_leaf.dtype) != (old_leaf.shape, old_leaf.dtype)
                    or not new_leaf.sharding.is_equivalent_to(old_leaf.sharding, new_leaf.ndim)):
                raise ValueError(f"{jax.tree_util.keystr(path)}: {new_leaf.shape} {new_leaf.dtype} "
                                 f"{new_leaf.sharding}, served as {old_leaf.shape} {old_leaf.dtype} {old_leaf.sharding}")
        self.weights = self.runner.weights = weights
        self.scheduler.prefix_cache.forget()

    @property
    def asleep(self) -> bool:
        """Whether :meth:`free_caches` left the engine without a KV cache."""
        return self.runner.caches is None

    def free_caches(self) -> int:
        """Frees the KV cache's device memory (and so the prefix cache); returns the bytes it
        held over all devices. Requests are refused until :meth:`restore_caches`."""
        self.refuse_while_busy("freeing the KV cache")
        caches = self.runner.caches
        if caches is None:
            return 0
        leaves = jax.tree.leaves(caches)
        freed = sum(leaf.nbytes for leaf in leaves)
        self.runner.caches = None
        for leaf in leaves:
            leaf.delete()
        self.scheduler.prefix_cache.forget()
        return freed

    def restore_caches(self) -> None:
        """A fresh KV cache of the same pages, after :meth:`free_caches` (nothing recompiles)."""
        if self.runner.caches is None:
            self.runner.caches = jax.block_until_ready(self.runner.allocate_caches())

    def refuse_while_busy(self, what: str) -> None:
        """RuntimeError naming ``what`` unless no request is queued, running or in flight."""
        if self.has_work or self._in_flight is not None:
            raise RuntimeError(f"{what} needs an idle engine: finish or abort its requests first")

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar:
        """``params.structured_outputs`` compiled (cached); thread-safe. :class:`InvalidRequest`
        naming ``structured_outputs.<kind>`` if it does not compile or this engine has no
        grammar compiler."""
        if self.grammar_compiler is None:
            raise InvalidRequest("structured_outputs", "this engine was built without a tokenizer for grammars")
        return self.grammar_compiler.compile(params.structured_outputs)

    def cached_prefix_tokens(self, prompt_ids: list[int], cache_salt: str | None = None) -> int:
        """Prompt tokens of ``prompt_ids`` the prefix cache holds now (a probe for routing;
        safe from another thread: it reads, and a stale answer only routes worse)."""
        return self.scheduler.prefix_cache.cached_tokens(list(prompt_ids), cache_key(cache_salt))

    def abort(self, request: Request, reason: str = "aborted") -> None:
        """Ends ``request`` now and frees its pages (before the next schedule)."""
        self.scheduler.abort(request, reason)

    @property
    def has_step_in_flight(self) -> bool:
        """Whether a step is launched and not finished (between turns, one is while there is work)."""
        return self._in_flight is not None

    def step(self) -> PipelineTurn | None:
        """Runs one turn of the step pipeline, the one way to run steps: finishes the step in
        flight (launching one first if none is) and leaves the next one in flight, so that
        the caller's work on the finished step (its deltas) overlaps the devices' work on
        the next. With ``async_scheduling`` the next step is launched before the finished
        one's result is read (the host schedules N+1 while the devices run N); without,
        after it is committed (N+1 is scheduled knowing N's tokens). None when nothing is
        in flight and nothing can be scheduled; :meth:`PipelineTurn.result` is the finished
        step's report, or its failure raised.

        Failures are returned, not raised, so that a turn whose launch fails still reports
        the step it finished: a failed launch has put nothing in flight; a failed result
        means every step in flight is forgotten, the caches reallocated and every running
        request preempted, to recompute what it had cached. An interrupt is raised, with
        the step that was in flight kept or, while waiting for its result, forgotten the
        same way (caches kept)."""
        failed, launched = [], []
        self._sample_deferred()
        if self._deferred_failure is not None:  # the step in flight could not be sampled: forgotten
            failed.append(self._deferred_failure)
            self._deferred_failure = None
        if self._in_flight is None:
            self._in_flight = self._launch_noting(launched, failed)
            if self._in_flight is None:
                return PipelineTurn(tuple(launched), None, tuple(failed)) if failed else None
        # (an interrupt while launching the next step leaves the current one in flight)
        # A turn that may speculate schedules after the commit: a draft follows tokens the host
        # knows, and a request verifying one cannot be scheduled again before its commit.
        drafting = self.scheduler.would_speculate and self._draft_backoff.try_drafting()
        ahead = self.config.async_scheduling and not (self._in_flight.scheduled.speculative or drafting)
        following = self._launch_noting(launched, failed) if ahead else None
        current, self._in_flight = self._in_flight, following
        self._drafter_work(current)
        try:
            finished = self._finish(current)
        except StepFailed as failure:
            return PipelineTurn(tuple(launched), None, (*failed, failure))
        if not ahead:
            self._in_flight = self._launch_noting(launched, failed)
            if drafting and self._in_flight is not None:
                self._draft_backoff.record(self._in_flight.scheduled.speculative)
        return PipelineTurn(tuple(launched), finished, tuple(failed))

    def run_until_done(self, requests: list[Request], on_step: Callable[[StepReport], None] | None = None) -> None:
        """Runs :meth:`step` until every one of ``requests`` has finished, raising a turn's
        first failure (:meth:`PipelineTurn.result`); ``on_step`` receives each finished
        step's report (the offline ``LLM`` makes its deltas there). The step launched last
        may stay in flight when it returns (the next call finishes it)."""
        while not all(r.finished for r in requests):
            if not self.scheduler.has_work:
                raise RuntimeError("requests are unfinished but the scheduler holds none")
            turn = self.step()
            if turn is None:  # nothing in flight and nothing fits: they would never finish
                raise RuntimeError("requests are unfinished but no step can be scheduled")
            report = turn.result()
            if on_step is not None:
                on_step(report)

    def _launch_noting(self, launched: list, failed: list) -> LaunchedStep | None:
        try:
            step = self._launch()
        except StepFailed as failure:
            failed.append(failure)
            return None
        if step is not None:
            launched.append(step)
        return step

    def forget_in_flight(self) -> None:
        """Drops the step in flight uncommitted (for a caller whose own bookkeeping failed):
        every running request goes back to the queue and recomputes."""
        self._start_over(new_caches=False)

    def _launch(self) -> LaunchedStep | None:
        """The first half of a step (:meth:`step`): schedules and dispatches it without
        waiting for the device. It may be called once more before the step is finished
        (the next step then decodes this one's samples on the device); steps are finished
        in the order they were launched."""
        start = time.perf_counter()
        self._sample_deferred()  # the step this one may take tokens from is sampled first
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return None
        try:
            bucket, mode = bucket_and_mode(scheduled, self.executables.ladder, self.policy)
            if not scheduled.constrained:
                return self.runner.launch(scheduled, mode, bucket, start)
            if scheduled.masks_wait:  # sampled once the step in flight is committed (_finish)
                return self.runner.launch(scheduled, mode, bucket, start, defer_sampling=True)
            return self.runner.launch(scheduled, mode, bucket, start, bitmask=self._masks(scheduled, bucket[1]))
        except BaseException as error:  # an interrupt too: nothing may stay scheduled but unlaunched
            self.scheduler.forget(scheduled)
            if self.runner.recover_caches():
                self.scheduler.preempt_all(caches_lost=True)
            if not isinstance(error, Exception):
                raise
            raise StepFailed(scheduled.requests) from error

    def _finish(self, launched: LaunchedStep) -> StepReport:
        """The second half: waits for the step's result and commits it to its requests."""
        scheduled, mode = launched.scheduled, launched.mode
        self._sample_deferred()
        if self._deferred_failure is not None and not launched.sampled:  # it was this step
            failure, self._deferred_failure = self._deferred_failure, None
            raise failure
        try:
            result = self.runner.finish(launched)
        except Exception as error:
            # A step that fails on the devices can leave its output caches unusable without
            # deleting them, and a step launched after it read them: start again from fresh
            # caches, every running request recomputing what it had cached.
            self._start_over(new_caches=True)
            raise StepFailed(scheduled.requests) from error
        except BaseException:  # interrupted while waiting (a notebook's Ctrl-C): recompute
            self._start_over(new_caches=False)
            raise
        switched = self.counters.count(mode, scheduled.num_tokens)
        try:
            finished = self.scheduler.commit(scheduled, result.tokens, result.logprobs, mode,
                                             result.top_ids, result.top_logprobs)
            self._start_deferred_masks()
        except BaseException:  # bookkeeping failed: nothing in flight may go on unsampled
            self._start_over(new_caches=False)
            raise
        now = time.perf_counter()
        seconds = now - max(launched.started, self._last_finished)
        self._last_finished = now
        return StepReport(mode=mode, num_tokens=scheduled.num_tokens, bucket=launched.bucket,
                          requests=scheduled.requests, sampled=scheduled.delivered, finished=finished,
                          switched=switched, seconds=seconds)

    def _drafter_work(self, launched: LaunchedStep) -> None:
        """The drafter's work that can wait (suffix decoding learning finished outputs), while
        the devices run ``launched``: until its result is ready, at least a part a step."""
        drafter = self.scheduler.drafter
        if drafter is not None and launched.host_copy is not None:
            drafter.learn_pending(launched.host_copy.is_ready)

    def _masks(self, scheduled, num_rows: int) -> np.ndarray:
        """The bitmask of ``scheduled``'s rows, filled now (:meth:`_fill_masks`)."""
        bitmask, seconds, rows = self._fill_masks(scheduled, self._mask_rows(scheduled), num_rows)
        self.counters.count_masks(rows, seconds)
        return bitmask

    @staticmethod
    def _mask_rows(scheduled) -> list:
        """``(grammar state, row)`` of ``scheduled``'s constrained rows whose requests are still
        live (a row of a request that ended or was preempted since allows every token)."""
        return [(scheduled.requests[b].grammar, scheduled.row_of(b)) for b in scheduled.constrained
                if not scheduled.requests[b].finished
                and scheduled.requests[b].preemptions == scheduled.preemptions[b]]

    def _fill_masks(self, scheduled, rows: list, num_rows: int) -> tuple[np.ndarray, float, int]:
        """Each row's grammar's allowed tokens, the other rows (to ``num_rows``, the step's
        sequence bucket, so that the runner uploads it as it is) all ones; the seconds it
        took. Reads only the grammar states, which nothing advances before the step is
        sampled, so it may run on the mask thread."""
        started = time.perf_counter()
        bitmask = allow_all(num_rows, self.weights.config.vocab_size)
        self._mask_filler.fill(bitmask, rows)
        return bitmask, time.perf_counter() - started, len(rows)

    def _start_deferred_masks(self) -> None:
        """After a commit: if the step launched after it waits for its masks, starts filling
        them on the mask thread (llguidance releases the GIL), so that the fill overlaps the
        caller's work on the committed step (its deltas); :meth:`_sample_deferred` takes them."""
        following = self.runner.last_launched
        if following is None or following.sampled or self._deferred_masks is not None:
            return
        rows = self._mask_rows(following.scheduled)  # on this thread: it reads the requests
        self._deferred_masks = (following, self._mask_thread.submit(self._fill_masks, following.scheduled, rows,
                                                                        following.bucket[1]))

    def _sample_deferred(self) -> None:
        """Launches the sampler of the step whose masks are being filled, once they are,
        before anything reads that step's result. A failure forgets that step (its requests
        recompute) and is reported by :meth:`step`."""
        if self._deferred_masks is None:
            return
        following, masks = self._deferred_masks
        self._deferred_masks = None
        try:
            bitmask, seconds, rows = masks.result()
            self.counters.count_masks(rows, seconds)
            self.runner.sample_deferred(following, bitmask)
        except BaseException as error:  # an interrupt too: an unsampled step must not stay in flight
            self.scheduler.forget(following.scheduled)
            self.runner.forget_launched(new_caches=False)
            if self._in_flight is following:
                self._in_flight = None
            if not isinstance(error, Exception):
                raise
            failure = StepFailed(following.scheduled.requests)
            failure.__cause__ = error
            self._deferred_failure = failure

    def _start_over(self, new_caches: bool) -> None:
        """Forgets every step in flight: running requests go back to the queue (their
        commits, when they come, change nothing) and recompute what they had cached."""
        if self._deferred_masks is not None:  # let the fill end: it reads grammar states
            concurrent.futures.wait([self._deferred_masks[1]])
            self._deferred_masks = None
        self.runner.forget_launched(new_caches)
        self.scheduler.preempt_all(caches_lost=new_caches)
        self._in_flight = None
