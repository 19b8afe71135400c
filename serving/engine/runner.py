"""The devices' half of the engine: the weights, the donated KV cache, the compiled steps
and samplers. ``launch`` places a scheduled step and dispatches it without waiting;
``finish`` waits for its one small result and brings it to the host. The runner knows no
requests: the engine's scheduler decides what runs, the policy in which mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from shiftjax.cache import KVCache
from shiftjax.serving.engine import transfers
from shiftjax.serving.engine.buckets import pad_batch
from shiftjax.serving.engine.executables import Executables
from shiftjax.serving.engine.sampler_executables import Samplers, needs_sampler
from shiftjax.serving.engine.scheduler import ScheduledStep
from shiftjax.steps import params_for
from shiftjax.weights import ModelWeights


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step dispatched to the devices whose result is not yet on the host."""

    scheduled: ScheduledStep
    mode: str
    bucket: tuple[int, int]
    packed: jax.Array  # on every device: the next step's token fill reads it
    host_copy: jax.Array  # one device's copy, already on its way to the host
    started: float  # time.perf_counter() when it was scheduled


class StepRunner:
    """``allocate_caches()`` makes a fresh, zeroed KV cache (start-up, and recovery after a
    step that failed on the devices)."""

    def __init__(self, weights: ModelWeights, executables: Executables, samplers: Samplers, caches: KVCache,
                 allocate_caches: Callable[[], KVCache]):
        self.weights = weights
        self.executables = executables
        self.samplers = samplers
        self.caches = caches
        self._allocate_caches = allocate_caches
        options = executables.options
        self._no_previous = transfers.empty_result(weights, executables.ladder.result_rows, options.max_top_logprobs)
        self._last_launched: LaunchedStep | None = None  # the source of the next step's sampled tokens

    def launch(self, scheduled: ScheduledStep, mode: str, bucket: tuple[int, int], started: float) -> LaunchedStep:
        """Pads, places and dispatches ``scheduled`` in ``mode``'s executable of ``bucket``,
        with the caches donated, and requests its result's copy to the host. A step that
        takes sampled tokens takes them from the step launched just before (on the devices)."""
        num_tokens, num_seqs = bucket
        previous, token_source = self._sampled_token_source(scheduled)
        upload = transfers.place_upload(pad_batch(scheduled.batch, num_tokens, num_seqs), self.weights, token_source)
        executable = self.executables.get(mode, num_tokens, num_seqs)
        out, self.caches = executable(params_for(self.weights, mode), self.caches, upload, previous)
        packed = self.samplers(out.logits, upload.sequences) if needs_sampler(scheduled.batch) else out.packed
        host_copy = transfers.start_host_copy(packed)
        self._last_launched = LaunchedStep(scheduled, mode, bucket, packed, host_copy, started)
        return self._last_launched

    def _sampled_token_source(self, scheduled: ScheduledStep):
        """The result a step takes sampled tokens from (on the devices) and, per token, the
        row that holds it (None: the step takes none)."""
        if not scheduled.takes_sampled_tokens:
            return self._no_previous, None
        source = self._last_launched
        if source is None or source.scheduled.step_id != scheduled.source_step:
            raise RuntimeError(f"step {scheduled.step_id} takes tokens from step {scheduled.source_step}, "
                               "which is not the last one launched")
        return source.packed, scheduled.token_source

    @staticmethod
    def finish(launched: LaunchedStep) -> transfers.StepResult:
        """Waits for ``launched``'s result and unpacks it on the host."""
        return transfers.unpack_host(transfers.packed_to_host(launched.host_copy))

    def forget_launched(self, new_caches: bool) -> None:
        """Forgets every launched step (no later step takes tokens from them); with
        ``new_caches``, a fresh cache replaces one a failed step may have left unusable."""
        if new_caches:
            self.caches = self._allocate_caches()
        self._last_launched = None

    def recover_caches(self) -> bool:
        """After a failed launch: a fresh cache if the failed call consumed the donated one.
        Whether it did (what the cache held is then lost)."""
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches)):
            self.caches = self._allocate_caches()
            return True
        return False
