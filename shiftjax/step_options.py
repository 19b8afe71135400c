"""How a step is built: one frozen object, the same for every bucket and mode of an engine
(so that TP and SP steps do the same arithmetic), and part of every compiled step's key."""

from __future__ import annotations

import dataclasses

from shiftjax.kernels.collectives import ALL_REDUCES, ALL_TO_ALLS
from shiftjax.kernels.fp8_gemm import DEFAULT_CHOICE, Fp8GemmChoice

ATTENTIONS = ("reference", "pallas", "auto")
LAYER_LOOPS = ("scan", "unrolled")
GEMM_BACKENDS = ("triton", "cublas")
QUANTIZED_GEMMS = ("reference", "pallas", "auto")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """``make_step`` reads ``attention``, ``layer_loop``, ``max_top_logprobs``,
    ``sample_in_step``, ``all_reduce`` and ``all_to_all``; the engine's lowering reads
    ``max_pages`` (the page table's width) and its compiler ``gemm`` and ``xla_options``.

    - ``layer_loop``: ``scan`` keeps compile time flat in depth; ``unrolled`` is faster on
      GPUs, where the scan copies each layer's weights (``model.run_layers``).
    - ``max_top_logprobs``: alternatives a sampled token can carry; static, it fixes the
      packed result's width.
    - ``sample_in_step=False``: the step packs greedy tokens and returns the logits for the
      engine's separate sampler (``make_step`` says why).
    - ``all_reduce`` / ``all_to_all``: who does TP mode's sums and SP mode's exchanges,
      ``xla`` or ``one_shot`` (``kernels/collectives.py``; two GPUs, set up first).
    - ``gemm``: ``cublas`` or ``triton`` GEMMs on GPUs (``serving/engine/compile.py``).
    - ``quantized_gemm``: who multiplies FP8 weights (``kernels/fp8_gemm.py``): the XLA
      ``reference``, the Mosaic GPU kernels (``pallas``), or ``auto``: the kernels where
      every device of the mesh is a Hopper GPU (sm_90, what they are written and measured
      for), the reference elsewhere (the CPU, and GPUs they were not tried on).
    - ``fp8_gemm``: which algorithm (by the step's token count) and which GPU kernel (by the
      GEMM's rows) multiply FP8 weights (``kernels.fp8_gemm.Fp8GemmChoice``).
    - ``cuda_graph_max_tokens``: on GPUs, steps of more tokens launch their kernels one by
      one instead of through XLA's command buffers (CUDA graphs): their kernels outlast their
      launches, so a graph saves them nothing, and where the step's buffers moved since its
      last run (JAX's default allocator) XLA re-records the graph before launching it, with
      the device idle (``serving/engine/compile.py``). None: graphs for every step.
    - ``xla_options``: more XLA options for every step, as ``(name, value)`` pairs (a
      benchmark's variant; the engine adds none).
    """

    max_pages: int | None = None  # None: a step made alone, not lowered by the engine
    attention: str = "auto"
    layer_loop: str = "scan"
    gemm: str = "cublas"
    max_top_logprobs: int = 0
    sample_in_step: bool = True
    all_reduce: str = "xla"
    all_to_all: str = "xla"
    quantized_gemm: str = "auto"
    fp8_gemm: Fp8GemmChoice = DEFAULT_CHOICE
    cuda_graph_max_tokens: int | None = 512
    xla_options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        choices = {"attention": ATTENTIONS, "layer_loop": LAYER_LOOPS, "gemm": GEMM_BACKENDS,
                   "all_reduce": ALL_REDUCES, "all_to_all": ALL_TO_ALLS, "quantized_gemm": QUANTIZED_GEMMS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.max_pages is not None and self.max_pages < 1:
            raise ValueError(f"max_pages must be at least 1, got {self.max_pages}")
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens < 1:
            raise ValueError(f"cuda_graph_max_tokens must be at least 1 or None, got {self.cuda_graph_max_tokens}")
        if self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be at least 0, got {self.max_top_logprobs}")
        if not all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                   for pair in self.xla_options):
            raise ValueError(f"xla_options must be (name, value) pairs, got {self.xla_options!r}")

    def replace(self, **changes) -> StepOptions:
        return dataclasses.replace(self, **changes)

    def key(self) -> dict:
        """Every field, for a compiled step's store key."""
        return dataclasses.asdict(self)
