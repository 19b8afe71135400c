"""The engine: scheduler, caches and compiled steps, one step at a time.

``Engine.step()`` schedules a batch, pads it to its bucket, lets the shift policy pick the
mode, runs that mode's executable with the caches donated, rebinds the caches, and
commits the one small result array to the requests.
"""

from __future__ import annotations

import dataclasses

import jax

from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.serving import executables as exe
from shiftjax.serving.policy import ShiftPolicy
from shiftjax.serving.sampling_params import SamplingParams
from shiftjax.serving.scheduler import Request, Scheduler, SchedulerConfig
from shiftjax.steps import params_for
from shiftjax.weights import ModelWeights


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 1024
    page_size: int = 16
    num_pages: int | None = None  # default: every sequence slot can reach max_model_len
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    token_buckets: tuple[int, ...] | None = None  # default: BucketLadder.geometric
    seq_buckets: tuple[int, ...] | None = None
    mode: str = "auto"  # tp | sp | auto | alternate
    shift_threshold: int | None = None  # with mode auto: SP from this many tokens up
    attention: str = "auto"  # reference | pallas | auto
    # scan | unrolled | auto (unrolled on GPUs, where the scan copies every layer's weights
    # each step: 2.3x slower decode on the H200; scan elsewhere, for compile time)
    layer_loop: str = "auto"
    cache_dtype: str | None = None  # default: the weights' dtype
    max_queue: int = 1024

    def __post_init__(self):
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.attention not in ("reference", "pallas", "auto"):
            raise ValueError(f"attention must be reference, pallas or auto, got {self.attention!r}")
        if self.layer_loop not in ("scan", "unrolled", "auto"):
            raise ValueError(f"layer_loop must be scan, unrolled or auto, got {self.layer_loop!r}")

    def pages(self) -> int:
        per_seq = -(-self.max_model_len // self.page_size)
        return self.num_pages or self.max_num_seqs * per_seq + 1


class Engine:
    def __init__(self, weights: ModelWeights, config: EngineConfig, eos_token_ids=()):
        self.weights = weights
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        model = weights.config
        if config.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model.max_position_embeddings})")
        sp = weights.dims.sp
        self.modes = ("tp", "sp") if sp > 1 else ("tp",)
        if config.token_buckets is None:
            ladder = exe.BucketLadder.geometric(
                config.max_num_batched_tokens, config.max_num_seqs, multiple=sp)
        else:
            ladder = exe.BucketLadder(tuple(config.token_buckets),
                                      tuple(config.seq_buckets or (config.max_num_seqs,)))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=min(config.max_num_batched_tokens, ladder.token_buckets[-1]),
            max_num_seqs=min(config.max_num_seqs, ladder.seq_buckets[-1]),
            max_model_len=config.max_model_len, page_size=config.page_size,
            num_pages=config.pages(), max_queue=config.max_queue))
        dtype = config.cache_dtype or str(weights.tp.embed.dtype)
        cache = CacheConfig(num_pages=config.pages(), page_size=config.page_size, dtype=dtype)
        self.caches = allocate_cache(weights.mesh, model.num_layers, weights.layout.kv_slots,
                                     model.head_dim, cache)
        max_pages = self.scheduler.config.max_pages_per_seq
        layer_loop = config.layer_loop
        if layer_loop == "auto":
            layer_loop = "unrolled" if jax.default_backend() == "gpu" else "scan"
        self.executables = exe.compile_all(weights, self.caches, ladder, self.modes, max_pages=max_pages,
                                           attention=config.attention, layer_loop=layer_loop)
        if config.mode == "auto" and len(self.modes) > 1 and config.shift_threshold is None:
            self.caches = exe.time_executables(self.executables, weights, self.caches, max_pages)
        self.policy = ShiftPolicy(config.mode, self.modes, self.executables.run_seconds,
                                  threshold=config.shift_threshold)
        self.stats = {"steps": 0, "switches": 0, "tokens": 0, "last_mode": None}

    @property
    def compile_seconds(self) -> float:
        """Compile time summed over executables (they compile concurrently, so the wall
        time is less)."""
        return sum(self.executables.compile_seconds.values())

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        vocab = self.weights.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return self.scheduler.add(prompt_ids, params, self.eos_token_ids)

    def step(self) -> list[Request]:
        """Runs one step; returns the requests that finished in it."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        num_tokens, num_seqs = self.executables.ladder.pick(scheduled.num_tokens, len(scheduled.requests))
        mode = self.policy.choose(num_tokens, num_seqs)
        batch = exe.to_device(exe.pad_batch(scheduled.batch, num_tokens, num_seqs), self.weights)
        executable = self.executables.get(mode, num_tokens, num_seqs)
        out, self.caches = executable(params_for(self.weights, mode), self.caches, batch)
        tokens, logprobs = exe.unpack_host(exe.packed_to_host(out.packed))
        self._count(mode, scheduled.num_tokens)
        return self.scheduler.commit(scheduled, tokens, logprobs, mode)

    def _count(self, mode: str, tokens: int) -> None:
        stats = self.stats
        stats["switches"] += stats["last_mode"] not in (None, mode)
        stats["steps"] += 1
        stats["tokens"] += tokens
        stats["last_mode"] = mode

    def run_until_done(self, requests: list[Request]) -> None:
        while not all(r.finished for r in requests):
            if not self.scheduler.has_work:
                raise RuntimeError("requests are unfinished but the scheduler holds none")
            self.step()

