"""The devices' half of the engine: the weights, the donated KV cache, the compiled steps
and samplers. ``launch`` places a scheduled step and dispatches it without waiting;
``finish`` waits for its one small result and brings it to the host. The runner knows no
requests: the engine's scheduler decides what runs, the policy in which mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from shiftjax.cache import KVCache
from shiftjax.serving.engine import transfers
from shiftjax.serving.engine.buckets import pad_batch
from shiftjax.serving.engine.executables import Executables
from shiftjax.serving.engine.sampler_executables import Samplers, needs_sampler
from shiftjax.serving.engine.scheduler import ScheduledStep
from shiftjax.steps import params_for
from shiftjax.weights import ModelWeights


@dataclasses.dataclass(eq=False)
class LaunchedStep:
    """A step dispatched to the devices whose result is not yet on the host.

    A step whose grammar masks wait for the previous step's tokens (``masks_wait``) is
    launched without its sampling: ``packed`` and ``host_copy`` are None, ``logits`` and
    ``sequences`` kept, until :meth:`StepRunner.sample_deferred` samples it."""

    scheduled: ScheduledStep
    mode: str
    bucket: tuple[int, int]
    packed: jax.Array | None  # on every device: the next step's token fill reads it
    host_copy: jax.Array | None  # one device's copy, already on its way to the host
    started: float  # time.perf_counter() when it was scheduled
    logits: jax.Array | None = None
    sequences: jax.Array | None = None

    @property
    def sampled(self) -> bool:
        return self.packed is not None


class StepRunner:
    """``allocate_caches()`` makes a fresh, zeroed KV cache (start-up, and recovery after a
    step that failed on the devices)."""

    def __init__(self, weights: ModelWeights, executables: Executables, samplers: Samplers, caches: KVCache,
                 allocate_caches: Callable[[], KVCache]):
        self.weights = weights
        self.executables = executables
        self.samplers = samplers
        self.caches = caches
        self.allocate_caches = allocate_caches
        options = executables.options
        self._no_previous = transfers.empty_result(weights, executables.ladder.result_rows, options.max_top_logprobs)
        self._last_launched: LaunchedStep | None = None  # the source of the next step's sampled tokens

    def launch(self, scheduled: ScheduledStep, mode: str, bucket: tuple[int, int], started: float, *,
               bitmask: np.ndarray | None = None, defer_sampling: bool = False) -> LaunchedStep:
        """Pads, places and dispatches ``scheduled`` in ``mode``'s executable of ``bucket``,
        with the caches donated, and requests its result's copy to the host. A step that
        takes sampled tokens takes them from the step launched just before (on the devices).
        ``bitmask`` (``[rows, words]``, rows the step's sequences): the grammar masks its
        samples keep to; ``defer_sampling``: dispatch the model only (``sample_deferred``)."""
        num_tokens, num_seqs = bucket
        previous, token_source = self._sampled_token_source(scheduled)
        upload = transfers.place_upload(pad_batch(scheduled.batch, num_tokens, num_seqs), self.weights, token_source)
        executable = self.executables.get(mode, num_tokens, num_seqs)
        out, self.caches = executable(params_for(self.weights, mode), self.caches, upload, previous)
        launched = LaunchedStep(scheduled, mode, bucket, None, None, started, out.logits, upload.sequences)
        if not defer_sampling:
            use_sampler = bitmask is not None or needs_sampler(scheduled.batch)
            self._sample(launched, bitmask, out.packed if not use_sampler else None)
        self._last_launched = launched
        return launched

    @property
    def last_launched(self) -> LaunchedStep | None:
        """The step launched last, until it is forgotten."""
        return self._last_launched

    def sample_deferred(self, launched: LaunchedStep, bitmask: np.ndarray) -> None:
        """Samples a step launched with ``defer_sampling`` within ``bitmask``; before the
        next step is launched (that step reads this one's samples on the devices)."""
        if launched.sampled or launched is not self._last_launched:
            raise RuntimeError(f"step {launched.scheduled.step_id} is sampled already or not the last launched")
        self._sample(launched, bitmask, None)

    def _sample(self, launched: LaunchedStep, bitmask: np.ndarray | None, packed: jax.Array | None) -> None:
        if packed is None:
            placed = None
            if bitmask is not None:
                rows = launched.bucket[1]
                if len(bitmask) < rows:  # padding sequences allow every token
                    bitmask = np.concatenate([bitmask, np.full((rows - len(bitmask), bitmask.shape[1]), -1, np.int32)])
                placed = transfers.place_replicated(bitmask, self.weights)
            packed = self.samplers(launched.logits, launched.sequences, placed,
                                   greedy=not needs_sampler(launched.scheduled.batch))
        launched.packed, launched.host_copy = packed, transfers.start_host_copy(packed)
        launched.logits = launched.sequences = None

    def _sampled_token_source(self, scheduled: ScheduledStep):
        """The result a step takes sampled tokens from (on the devices) and, per token, the
        row that holds it (None: the step takes none)."""
        if not scheduled.takes_sampled_tokens:
            return self._no_previous, None
        source = self._last_launched
        if source is None or source.scheduled.step_id != scheduled.source_step or not source.sampled:
            raise RuntimeError(f"step {scheduled.step_id} takes tokens from step {scheduled.source_step}, "
                               "which is not the last one launched and sampled")
        return source.packed, scheduled.token_source

    @staticmethod
    def finish(launched: LaunchedStep) -> transfers.StepResult:
        """Waits for ``launched``'s result and unpacks it on the host."""
        if not launched.sampled:
            raise RuntimeError(f"step {launched.scheduled.step_id} was launched without sampling and never sampled")
        return transfers.unpack_host(transfers.packed_to_host(launched.host_copy))

    def forget_launched(self, new_caches: bool) -> None:
        """Forgets every launched step (no later step takes tokens from them); with
        ``new_caches``, a fresh cache replaces one a failed step may have left unusable."""
        if new_caches:
            self.caches = self.allocate_caches()
        self._last_launched = None

    def recover_caches(self) -> bool:
        """After a failed launch: a fresh cache if the failed call consumed the donated one.
        Whether it did (what the cache held is then lost)."""
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches)):
            self.caches = self.allocate_caches()
            return True
        return False
