"""The engine options ``shiftjax generate`` and ``shiftjax serve`` share, and what builds
an engine or an offline :class:`LLM` from them (the service builders are
``serving/server/service_args.py``).

JAX is configured here, from arguments, before anything compiles: the platform (virtual
CPU devices), a multi-process mesh, and the persistent compilation cache (through
``jax.config``, not environment variables). The page pool is reported on stderr at start,
and so is compile progress.

Speculative decoding's options are :class:`SpeculativeConfig`'s fields, each a flag whose
default is the dataclass's; a value it refuses, or an option without ``--speculative-method``,
is a usage error naming the flag (:func:`engine_arguments_error`), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from shiftjax.serving.engine.policy import POLICIES
from shiftjax.serving.engine.speculative import SPECULATIVE_METHODS, SpeculativeConfig  # imports no JAX

LOAD_FORMATS = ("orbax", "dummy")


def default_compilation_cache_dir() -> Path:
    """``<repo>/.cache/shiftjax/xla`` when shiftjax runs from its source tree, else the same
    path under the current directory (as the default model's cache)."""
    repo = Path(__file__).resolve().parents[2]
    root = repo if (repo / "pyproject.toml").is_file() else Path.cwd()
    return root / ".cache" / "shiftjax" / "xla"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the model, mesh, engine, page-pool and start-up options."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="default",
                       help="a shiftjax checkpoint dir, or 'default'; with --load-format dummy, a HF config.json")
    model.add_argument("--load-format", choices=LOAD_FORMATS, default="orbax",
                       help="orbax: restore the checkpoint; dummy: random weights of the model's shape")
    model.add_argument("--tokenizer", default=None,
                       help="a directory with tokenizer.json (default: the checkpoint's, or the default model's)")
    model.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    model.add_argument("--weight-storage", choices=("aliased", "two_copies"), default="aliased")
    # shiftjax.quantization.QUANTIZATIONS (not imported: JAX is configured after parsing)
    model.add_argument("--quantization", choices=("none", "fp8"), default=None,
                       help="fp8: the layer GEMM weights in float8_e4m3fn with per-channel scales, quantized "
                            "as they load (embedding, norms and LM head stay in --dtype); none: every weight in "
                            "--dtype (default: as the checkpoint says: fp8 for one converted from an FP8 "
                            "checkpoint, else none)")
    model.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "float32", "fp8"), default="auto",
                       help="the KV cache's dtype; fp8: float8_e4m3fn (half of bf16's bytes, twice the tokens "
                            "per GiB; scales 1.0); auto: the activations' dtype")
    mesh = parser.add_argument_group("mesh")
    mesh.add_argument("--sp", type=int, default=1)
    mesh.add_argument("--tp", type=int, default=1)
    mesh.add_argument("--cpu-devices", type=int, default=None,
                      help="run on N virtual CPU devices (try meshes without GPUs)")
    mesh.add_argument("--coordinator", default=None,
                      help="host:port of process 0, for a mesh over several processes")
    mesh.add_argument("--num-processes", type=int, default=1)
    mesh.add_argument("--process-id", type=int, default=0)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--mode", choices=POLICIES, default="auto")
    engine.add_argument("--shift-threshold", type=int, default=None,
                        help="with --mode auto: SP mode from this many tokens per step up")
    engine.add_argument("--max-model-len", type=int, default=512)
    engine.add_argument("--max-num-seqs", type=int, default=8)
    engine.add_argument("--max-num-batched-tokens", type=int, default=128)
    engine.add_argument("--max-queue", type=int, default=1024, help="requests waiting beyond this are refused")
    engine.add_argument("--page-size", type=int, default=16)
    engine.add_argument("--token-buckets", type=_id_list, default=None, metavar="16,64,128",
                        help="token counts to compile a step for (default: 16 x 4**i up to the max)")
    engine.add_argument("--seq-buckets", type=_id_list, default=None, metavar="1,4,8",
                        help="sequence counts to compile a step for (default: the token buckets below the max, "
                             "then the max; with --token-buckets given, the max alone)")
    engine.add_argument("--attention", choices=("reference", "pallas", "auto"), default="auto")
    # step_options.GEMM_BACKENDS (not imported: this module is read before JAX is configured)
    engine.add_argument("--gemm", choices=("triton", "cublas"), default="cublas",
                        help="who runs the GEMMs on GPUs: cuBLAS (compiles and prefills faster) or XLA's "
                             "autotuned Triton GEMMs (one sequence decodes a little faster)")
    # kernels.collectives.ALL_REDUCES (not imported, as above)
    engine.add_argument("--all-reduce", choices=("auto", "xla", "one_shot"), default="auto",
                        help="who sums TP mode's partials over the GPUs: XLA's psum (NCCL), or on exactly two "
                             "GPUs shiftjax's one-shot kernel, compiled with nvcc on first use, which XLA keeps "
                             "inside its CUDA graphs (the same sums); auto: one_shot where the mesh is two GPUs "
                             "and the kernel builds")
    engine.add_argument("--all-to-all", choices=("auto", "xla", "one_shot"), default="auto",
                        help="who does SP mode's all-to-alls: NCCL's, or on exactly two GPUs shiftjax's one-shot "
                             "exchange (the same kernel library, the same bytes); auto: one_shot where the mesh "
                             "is two GPUs and the kernel builds")
    engine.add_argument("--compile-workers", type=int, default=None,
                        help="executables compiled at once at start-up (default: all on the CPU; on GPUs "
                             "one with Triton GEMMs, whose autotuning serialises, and a quarter of the usable "
                             "cores with cuBLAS)")
    engine.add_argument("--max-top-logprobs", type=int, default=20,
                        help="alternatives per token a request may ask for (0: none; a narrower step result)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share the KV-cache pages of a prompt's leading full pages with later requests "
                             "whose prompt starts the same (vLLM's automatic prefix caching; a request's "
                             "cache_salt keeps its pages to requests of the same salt); on by default")
    engine.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="wait for each step before scheduling the next (default: the next is "
                             "scheduled and dispatched while the devices run the current one)")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=int, default=None,
                      help="KV-cache pages, page 0 (scratch) included")
    pool.add_argument("--kv-memory-fraction", type=float, default=None,
                      help="fraction of the device memory left after weights and step temporaries to give "
                           "the KV cache (default 0.9; needs a backend with memory statistics)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compilation-cache", type=Path, default=None, metavar="DIR",
                       help=f"persistent XLA compilation cache (default: {default_compilation_cache_dir()})")
    cache.add_argument("--no-compilation-cache", action="store_true", help="compile everything at every start")
    parser.add_argument("--executable-store", action="store_true",
                        help="also keep the compiled steps in DIR/executables, so that a warm start neither "
                             "traces nor lowers them (serving/engine/executable_store.py; one process only)")
    add_speculative_arguments(parser)


def _batch_size_limit(text: str) -> int | None:
    """``--speculative-disable-by-batch-size``: a number of requests, or ``none`` (no limit)."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests or 'none', got {text!r}") from None


# SpeculativeConfig's fields besides the method, as flags: (flag, field, type, metavar, the
# method it belongs to (None: both), help). Unset unless given (argparse.SUPPRESS), so that
# an option given without --speculative-method, or for the other method, can be refused.
SPECULATIVE_OPTIONS = (
    ("--num-speculative-tokens", "num_speculative_tokens", int, "K", None,
     "the most tokens a draft may have (a decoding request's step verifies up to 1 + K tokens)"),
    ("--speculative-disable-by-batch-size", "disable_by_batch_size", _batch_size_limit, "N", None,
     "no request speculates in a step scheduled while more than N requests run, where verification "
     "costs more than it saves ('none': at any batch size)"),
    ("--prompt-lookup-min", "prompt_lookup_min", int, "N", "ngram", "the shortest n-gram looked up"),
    ("--prompt-lookup-max", "prompt_lookup_max", int, "N", "ngram", "the longest n-gram looked up"),
    ("--suffix-max-depth", "suffix_max_depth", int, "N", "suffix", "the depth of the suffix trees"),
    ("--suffix-max-cached-requests", "suffix_max_cached_requests", int, "N", "suffix",
     "earlier requests whose outputs the global suffix tree holds"),
    ("--suffix-min-token-prob", "suffix_min_token_prob", float, "P", "suffix",
     "a draft ends where a token's estimated probability falls below P"),
    ("--suffix-max-spec-factor", "suffix_max_spec_factor", float, "F", "suffix",
     "a draft is at most F times as long as the match it continues"),
)
FLAG_OF_FIELD = {field: flag for flag, field, *_ in SPECULATIVE_OPTIONS}


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """``--speculative-method`` and its options (serving/engine/speculative.py)."""
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    group = parser.add_argument_group("speculative decoding", "draft-free speculation: drafts proposed on the "
                                      "host from the request's own tokens (ngram) or from suffix trees over them and "
                                      "over earlier outputs (suffix), verified in the step; the output is the same")
    group.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                       help="ngram: prompt lookup; suffix: suffix decoding (default: no speculation)")
    for flag, field, kind, metavar, method, help_text in SPECULATIVE_OPTIONS:
        default = "none" if defaults[field] is None else defaults[field]
        for_method = f"{method}: " if method else ""
        group.add_argument(flag, dest=field, type=kind, metavar=metavar, default=argparse.SUPPRESS,
                           help=f"{for_method}{help_text} (default: {default})")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The :class:`SpeculativeConfig` the flags give, None without ``--speculative-method``;
    ValueError, its sentence naming the flags, for a value the config refuses, for an option
    without ``--speculative-method`` and for an option of the other method."""
    given = {field: getattr(args, field) for _, field, *_ in SPECULATIVE_OPTIONS if hasattr(args, field)}
    method = args.speculative_method
    if method is None:
        if given:
            raise ValueError(f"{', '.join(FLAG_OF_FIELD[f] for f in given)}: speculative decoding is off; "
                             f"give --speculative-method ({' or '.join(SPECULATIVE_METHODS)}) to turn it on")
        return None
    for flag, field, _, _, belongs_to, _ in SPECULATIVE_OPTIONS:
        if field in given and belongs_to not in (None, method):
            raise ValueError(f"{flag} is an option of --speculative-method {belongs_to}, not {method}")
    try:
        return SpeculativeConfig(method=method, **given)
    except ValueError as error:
        raise ValueError(_in_flag_names(str(error))) from None


def _in_flag_names(message: str) -> str:
    """SpeculativeConfig's sentence with its field names spelled as the flags that set them."""
    for field in sorted(FLAG_OF_FIELD, key=len, reverse=True):
        message = message.replace(field, FLAG_OF_FIELD[field])
    return message


def engine_arguments_error(args: argparse.Namespace) -> str | None:
    """Why the engine options cannot run as given, or None: for the commands to report as a
    usage error (``parser.error``) before anything loads."""
    try:
        speculative_config(args)
    except ValueError as error:
        return str(error)
    if args.quantization not in (None, "none") and args.weight_storage != "aliased":
        return (f"--quantization {args.quantization} needs --weight-storage aliased (the contiguous SP copy "
                f"would quantize activations differently from TP mode)")
    return None


def _id_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def configure_jax(args: argparse.Namespace) -> Path | None:
    """Platform, multi-process mesh and persistent compilation cache, from the arguments;
    must run before anything uses a JAX backend. Returns the cache directory (None: off)."""
    import jax

    if args.cpu_devices is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.coordinator is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if args.no_compilation_cache:
        return None
    cache_dir = Path(args.compilation_cache or default_compilation_cache_dir()).absolute()
    cache_dir.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    # Cache every executable: the steps are what matters, and the small ones cost nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir


def engine_options(args: argparse.Namespace) -> dict:
    """The :class:`EngineConfig` fields the arguments set."""
    cache_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype  # EngineConfig reads "fp8"
    return dict(mode=args.mode, shift_threshold=args.shift_threshold, max_model_len=args.max_model_len,
                cache_dtype=cache_dtype,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_queue=args.max_queue, page_size=args.page_size, attention=args.attention, gemm=args.gemm,
                all_reduce=args.all_reduce, all_to_all=args.all_to_all, compile_workers=args.compile_workers,
                token_buckets=args.token_buckets, seq_buckets=args.seq_buckets, num_pages=args.num_pages,
                kv_memory_fraction=args.kv_memory_fraction, max_top_logprobs=args.max_top_logprobs,
                async_scheduling=args.async_scheduling, enable_prefix_caching=args.enable_prefix_caching,
                speculative=speculative_config(args),
                executable_store=str(Path(args.compilation_cache or default_compilation_cache_dir()).absolute()
                                     / "executables") if args.executable_store else None)


def stderr_report(message: str) -> None:
    """Start-up progress for people: one line on stderr, flushed."""
    print(f"shiftjax: {message}", file=sys.stderr, flush=True)


def build_llm(args: argparse.Namespace, *, report=stderr_report, devices=None):
    """An offline :class:`LLM` as the arguments describe (call :func:`configure_jax` first);
    ``devices``: the mesh's devices (default: the first ``sp * tp``)."""
    from shiftjax.serving.engine.llm import LLM

    return LLM(args.model, sp=args.sp, tp=args.tp, dtype=args.dtype, weight_storage=args.weight_storage,
               load_format=args.load_format, quantization=args.quantization, tokenizer=args.tokenizer, report=report, devices=devices,
               **engine_options(args))
