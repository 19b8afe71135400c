"""The engine's sampler: run after a step (made with ``sample_in_step=False``) whose batch
has a row that samples or asks for alternatives, on that step's logits.

The step itself packs the greedy tokens, so an all-greedy step with no structured-output
row never runs this. Every sampler takes a grammar bitmask (``grammar.py``): a step with no
constrained row passes one that allows every token, kept on the devices per bucket, so it
uploads nothing more. This never skips anything with a conditional: on a GPU a conditional blocks the host until the
device reaches it (``steps.make_step``). One executable per sequence bucket, compiled at
start like the steps; it reads the per-sequence half of the step's upload
(``batch_upload.py``) and pads its result to the steps' result rows, so that the next
step reads it as it would the step's own.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import jax
import numpy as np

from shiftjax.batch import StepBatch
from shiftjax.sampling import pack_greedy, pack_samples
from shiftjax.serving.engine.batch_upload import abstract_upload, unpack_sequences
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.compile import JaxCompileEvents
from shiftjax.serving.engine.executable_store import ExecutableStore, sampler_key
from shiftjax.serving.engine.grammar import allow_all, mask_words
from shiftjax.serving.engine.transfers import batch_sharding, pad_result, place_replicated
from shiftjax.step_options import StepOptions
from shiftjax.weights import ModelWeights


def needs_sampler(batch: StepBatch) -> bool:
    """Whether a host batch has a row that the step's greedy packing does not serve (a
    constrained row is the engine's to know: ``ScheduledStep.constrained``)."""
    return bool(np.any(batch.temperature > 0) or np.any(batch.top_logprobs > 0))


def sample_rows(logits, sequences, bitmask, *, max_top_logprobs: int, result_rows: int):
    """:func:`~shiftjax.sampling.pack_samples` of the upload's sequences within ``bitmask``,
    padded to ``result_rows``."""
    packed = pack_samples(logits, unpack_sequences(sequences), max_top_logprobs, bitmask=bitmask,
                          skip_unneeded=False)
    return pad_result(packed, result_rows)


def greedy_rows(logits, sequences, bitmask, *, max_top_logprobs: int, result_rows: int):
    """:func:`sample_rows` of a step whose rows are all greedy and want no alternatives (a
    step sampled here only for its grammar masks): an argmax within ``bitmask``, without
    the filters' sort over the vocabulary (the 8B shape's TPOT at 64 JSON-schema rows: 5.76 ms
    with this, 7.76 ms with sample_rows; benchmarks/README.md, "One GPU: structured outputs")."""
    del sequences  # the same arguments as sample_rows: one caller, one signature
    return pad_result(pack_greedy(logits, max_top_logprobs, bitmask), result_rows)


class Samplers:
    """Compiled :func:`sample_rows` and :func:`greedy_rows` per sequence bucket."""

    def __init__(self, compiled: dict[tuple[str, int], object], allow_all: dict[int, jax.Array],
                 loaded_from_store: int = 0):
        self.compiled = compiled  # ("sample" | "greedy", seqs) -> executable
        self.allow_all = allow_all  # per sequence bucket, on the devices: the bitmask of no grammar
        self.loaded_from_store = loaded_from_store

    @classmethod
    def compile(cls, weights: ModelWeights, ladder: BucketLadder, step_options: StepOptions,
                store: ExecutableStore | None = None, report: Callable[[str], None] | None = None) -> "Samplers":
        """Compiled for every sequence bucket of the steps that ``step_options`` build, or
        loaded from ``store`` (each loaded one is run once, as the engine runs its stored
        steps, and compiled again if that fails; what XLA compiles afresh is stored)."""
        sharding = batch_sharding(weights)
        max_pages = step_options.max_pages
        options = dict(max_top_logprobs=step_options.max_top_logprobs, result_rows=ladder.result_rows)
        functions = {"sample": jax.jit(functools.partial(sample_rows, **options)),
                     "greedy": jax.jit(functools.partial(greedy_rows, **options))}
        devices = list(weights.mesh.devices.flat)
        vocab = weights.config.vocab_size
        compiled, loaded = {}, 0
        with JaxCompileEvents() as events:
            for (kind, function), seqs in itertools.product(functions.items(), ladder.seq_buckets):
                logits = jax.ShapeDtypeStruct((seqs, vocab), np.float32, sharding=sharding)
                sequences = abstract_upload(1, seqs, max_pages, sharding).sequences
                bitmask = jax.ShapeDtypeStruct((seqs, mask_words(vocab)), np.int32, sharding=sharding)
                key = None if store is None else sampler_key(weights, seqs=seqs, max_pages=max_pages,
                                                             grammar_bitmask=True, kind=kind, **options)
                executable = None if store is None else store.load(key, devices, report)
                if executable is not None and _runs(executable, (logits, sequences, bitmask), weights, report):
                    compiled[kind, seqs], loaded = executable, loaded + 1
                    continue
                hits = events.cache_hits
                compiled[kind, seqs] = function.lower(logits, sequences, bitmask).compile()
                if store is not None and events.cache_hits == hits:  # only fresh compiles (executable_store.py)
                    store.save_reporting(key, compiled[kind, seqs], report)
        allow = {seqs: place_replicated(allow_all(seqs, vocab), weights) for seqs in ladder.seq_buckets}
        return cls(compiled, allow, loaded)

    def __call__(self, logits: jax.Array, sequences: jax.Array, bitmask: jax.Array | None = None, *,
                 greedy: bool = False) -> jax.Array:
        """The packed samples of a step from its logits and its upload's ``sequences``, within
        ``bitmask`` (placed, ``[seqs, words]``; None allows every token). ``greedy``: every
        row is greedy and wants no alternatives (:func:`greedy_rows`)."""
        seqs = logits.shape[0]
        executable = self.compiled["greedy" if greedy else "sample", seqs]
        return executable(logits, sequences, self.allow_all[seqs] if bitmask is None else bitmask)


def _runs(executable, arguments, weights: ModelWeights, report) -> bool:
    """Whether a stored sampler runs, on zeros (a deserialized program can load and fail)."""
    try:
        jax.block_until_ready(executable(*(place_replicated(np.zeros(x.shape, x.dtype), weights)
                                           for x in arguments)))
        return True
    except Exception as error:
        if report is not None:
            report(f"stored sampler failed when run ({type(error).__name__}: {error}); compiling it")
        return False
