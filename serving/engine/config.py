"""The engine's configuration: one frozen object, validated where it is made."""

from __future__ import annotations

import dataclasses

from shiftjax.cache import cache_dtype_named, check_cache_dtype, pages_for
from shiftjax.kernels.collectives import ALL_REDUCES, ALL_TO_ALLS
from shiftjax.serving.engine.speculative import SpeculativeConfig
from shiftjax.step_options import ATTENTIONS, GEMM_BACKENDS, LAYER_LOOPS


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 1024
    page_size: int = 16
    num_pages: int | None = None  # default: sized from device memory (page_budget.size_pool)
    kv_memory_fraction: float | None = None  # of the memory weights and temporaries leave
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    token_buckets: tuple[int, ...] | None = None  # default: BucketLadder.geometric
    seq_buckets: tuple[int, ...] | None = None
    mode: str = "auto"  # tp | sp | auto | alternate
    shift_threshold: int | None = None  # with mode auto: SP from this many tokens up
    attention: str = "auto"  # reference | pallas | auto
    # scan | unrolled | auto (unrolled on GPUs, where the scan copies every layer's weights
    # each step; scan elsewhere, for compile time)
    layer_loop: str = "auto"
    # cublas | triton: who runs the GEMMs on GPUs (compile.xla_compiler_options)
    gemm: str = "cublas"
    # auto | xla | one_shot: who sums TP mode's partials over the devices (kernels/collectives.py):
    # XLA's psum, or on a mesh of two GPUs shiftjax's one-shot kernel, which XLA keeps inside
    # its CUDA graphs. auto: one_shot where the mesh is two GPUs and the kernel builds.
    all_reduce: str = "auto"
    # auto | xla | one_shot: who does SP mode's two all-to-alls a layer, likewise
    all_to_all: str = "auto"
    # executables compiled at once at start-up (default: compile.compile_workers)
    compile_workers: int | None = None
    cache_dtype: str | None = None  # default: the weights' dtype; "fp8" is float8_e4m3fn
    max_queue: int = 1024
    max_top_logprobs: int = 20  # alternatives a step can return per token (0: none, narrower result)
    # a directory of compiled steps (executable_store.py): a warm start skips tracing and lowering
    executable_store: str | None = None
    # dispatch step N+1 before waiting for step N (host work overlaps the devices' work)
    async_scheduling: bool = True
    # share the K/V of full prompt pages across requests (prefix_cache.py)
    enable_prefix_caching: bool = True
    # draft-free speculative decoding (speculative.py); None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.layer_loop not in (*LAYER_LOOPS, "auto"):
            raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, auto, got {self.layer_loop!r}")
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"gemm must be one of {', '.join(GEMM_BACKENDS)}, got {self.gemm!r}")
        if self.all_reduce not in ("auto", *ALL_REDUCES):
            raise ValueError(f"all_reduce must be one of auto, {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")
        if self.all_to_all not in ("auto", *ALL_TO_ALLS):
            raise ValueError(f"all_to_all must be one of auto, {', '.join(ALL_TO_ALLS)}, got {self.all_to_all!r}")
        if self.compile_workers is not None and self.compile_workers < 1:
            raise ValueError(f"compile_workers must be at least 1, got {self.compile_workers}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {self.num_pages}")
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.num_pages is not None and self.kv_memory_fraction is not None:
            raise ValueError("give num_pages or kv_memory_fraction, not both")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}")
        if self.cache_dtype is not None:
            object.__setattr__(self, "cache_dtype", cache_dtype_named(self.cache_dtype))  # frozen: resolved once
            check_cache_dtype(self.cache_dtype, "EngineConfig.cache")
        if not 0 <= self.max_top_logprobs <= 20:
            raise ValueError(f"max_top_logprobs must be in [0, 20], got {self.max_top_logprobs}")

    def pages(self) -> int:
        """``num_pages``, or the fallback where memory cannot be measured: every sequence
        slot can reach max_model_len."""
        return self.num_pages or self.max_num_seqs * pages_for(self.max_model_len, self.page_size) + 1
