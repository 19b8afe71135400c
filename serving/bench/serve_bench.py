"""``shiftjax bench serve``: one workload against one running server.

The workload (lengths, send times, prompt ids) is built from the seed before anything is
sent, so two servers benchmarked with the same options get the same requests at the same
offsets.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import sys
import time
from pathlib import Path

import numpy as np

from shiftjax.serving.bench import metrics, prefix_cache_bound, prefix_workloads, workloads
from shiftjax.serving.bench.report import print_summary_table, write_json
from shiftjax.serving.bench.speculation import SpeculationReading, run_speculation

BACKENDS = ("grpc", "openai")
DATASETS = ("random", "trace", "hash-trace", "shared-prefix", "multi-turn")
TRACE_DATASETS = ("trace", "hash-trace")
DEFAULT_RANDOM_PROMPTS = 1000
DEFAULT_CACHE_BLOCK = 16  # shiftjax's default page size: the bound's block for synthetic prompts


@dataclasses.dataclass
class ServeBenchConfig:
    """Every option of one ``bench serve`` run (the result file records it whole)."""

    server: str
    backend: str = "grpc"
    dataset: str = "random"
    num_prompts: int | None = None  # random, shared-prefix: 1000 when not given (vLLM's default); trace: no cap
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    trace: str | None = None
    time_scale: float = 1.0
    start: float = 0.0
    duration: float | None = None
    max_input_len: int | None = None  # clip a trace's lengths to what the model allows
    max_output_len: int | None = None
    block_size: int | None = None  # hash-trace: tokens per hash id (512); the best-hit-rate bound's block (else 16)
    cache_blocks: int | None = None  # the bound's cache capacity in blocks; None: infinite
    prefix_len: int = 0  # shared-prefix: the shared prefix; multi-turn: a system prompt all conversations share
    suffix_len: int = 128  # shared-prefix: each prompt's own suffix
    conversations: int = 8  # multi-turn
    turns: int = 4
    turn_len: int = 128  # multi-turn: tokens of each new user message
    cache_salt: str | None = None  # sent with every request: the server shares cached pages within a salt only
    json_schema: str | None = None  # sent with every request: its output is JSON valid under this schema
    disable_speculation: bool = False  # sent with every request: none of them speculates
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    warmup_requests: int = 0
    goodput: list[str] = dataclasses.field(default_factory=list)
    percentiles: list[float] = dataclasses.field(default_factory=lambda: list(metrics.DEFAULT_PERCENTILES))
    tokenizer: str | None = None
    vocab_size: int | None = None
    model: str | None = None
    api_key_file: str | None = None
    label: str | None = None
    device: str | None = None
    progress: bool = True

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset in TRACE_DATASETS and not self.trace:
            raise ValueError(f"--dataset {self.dataset} needs --trace PATH (an Azure CSV or a JSONL trace; "
                             "hash-trace: JSONL with hash_ids)")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        metrics.parse_goodput(self.goodput)  # refuses a bad SLO before anything is sent

    @property
    def cache_block_size(self) -> int:
        """Tokens per block of the hash ids and of the best-hit-rate bound."""
        if self.block_size is not None:
            return self.block_size
        return prefix_workloads.HASH_BLOCK_SIZE if self.dataset == "hash-trace" else DEFAULT_CACHE_BLOCK


@dataclasses.dataclass
class Workload:
    requests: list[workloads.WorkloadRequest]
    prompts: list[list[int]]
    send_offsets: list[float]


def build_workload(config: ServeBenchConfig) -> Workload:
    """The requests, their prompt ids and their send times, all from ``config.seed``.

    Lengths, arrivals and prompt ids draw from three independent streams of the seed, so a
    rate sweep sends the same prompts at every rate (an infinite rate draws no gaps). A
    hash trace's blocks depend on their ids and the seed only. A multi-turn chat's arrivals
    are its conversations' starts, and its later turns' prompts only the new messages."""
    length_rng, arrival_rng, prompt_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(3))
    num_prompts = DEFAULT_RANDOM_PROMPTS if config.num_prompts is None else config.num_prompts
    vocabulary = prompt_vocabulary(config)
    if config.dataset in TRACE_DATASETS:
        rows = workloads.read_trace(config.trace)
        if config.dataset == "hash-trace":
            prefix_workloads.check_hash_ids(rows, config.cache_block_size)
        requests = workloads.window_trace(rows, start_s=config.start, duration_s=config.duration,
                                          time_scale=config.time_scale, max_requests=config.num_prompts)
        requests = workloads.clip_lengths(requests, config.max_input_len, config.max_output_len)
        offsets = [r.arrival_s for r in requests]
        prompts = (prefix_workloads.hash_trace_prompts(requests, config.cache_block_size, vocabulary, config.seed)
                   if config.dataset == "hash-trace" else workloads.prompt_token_ids(requests, vocabulary, prompt_rng))
    elif config.dataset == "multi-turn":
        requests = prefix_workloads.multi_turn_requests(config.conversations, config.turns, config.turn_len,
                                                        config.output_len, config.prefix_len)
        starts = workloads.arrival_offsets(config.conversations, config.request_rate, config.burstiness, arrival_rng)
        offsets = prefix_workloads.conversation_offsets(requests, starts)
        prompts = prefix_workloads.multi_turn_messages(requests, config.turn_len, config.prefix_len, vocabulary,
                                                       prompt_rng)
    elif config.dataset == "shared-prefix":
        requests = prefix_workloads.shared_prefix_requests(num_prompts, config.prefix_len, config.suffix_len,
                                                           config.output_len)
        offsets = workloads.arrival_offsets(len(requests), config.request_rate, config.burstiness, arrival_rng)
        prompts = prefix_workloads.shared_prefix_prompts(requests, config.prefix_len, vocabulary, prompt_rng)
    else:
        requests = workloads.random_requests(num_prompts, config.input_len, config.output_len,
                                             config.range_ratio, length_rng)
        offsets = workloads.arrival_offsets(len(requests), config.request_rate, config.burstiness, arrival_rng)
        prompts = workloads.prompt_token_ids(requests, vocabulary, prompt_rng)
    return Workload(requests, prompts, [float(t) for t in offsets])


def prompt_vocabulary(config: ServeBenchConfig) -> np.ndarray:
    """Ids prompts may use: ``--vocab-size`` (all of ``[0, N)``), else the non-special ids
    of ``--tokenizer``, else of the default model's tokenizer when it is prepared."""
    if config.vocab_size is not None:
        return workloads.allowed_token_ids(config.vocab_size)
    if config.tokenizer is not None:
        return workloads.tokenizer_token_ids(config.tokenizer)
    from shiftjax.checkpoints.default_model import default_cache_dir
    from shiftjax.checkpoints.format import is_complete_checkpoint

    if not is_complete_checkpoint(default_cache_dir()):
        raise ValueError("give --tokenizer DIR or --vocab-size N (the default model is not prepared: "
                         "`shiftjax prepare-default` prepares it)")
    return workloads.tokenizer_token_ids(default_cache_dir())


def make_backend(config: ServeBenchConfig):
    api_key = open(config.api_key_file).read().strip() if config.api_key_file else None
    if config.backend == "openai":
        from shiftjax.serving.bench.openai_backend import OpenAIBackend

        return OpenAIBackend(config.server, model=config.model, api_key=api_key, cache_salt=config.cache_salt,
                             json_schema=config.json_schema, disable_speculation=config.disable_speculation)
    from shiftjax.serving.bench.grpc_backend import GrpcBackend

    return GrpcBackend(config.server, api_key=api_key, cache_salt=config.cache_salt, json_schema=config.json_schema,
                       disable_speculation=config.disable_speculation)


async def run_serve_bench(config: ServeBenchConfig, workload: Workload | None = None) -> dict:
    """Runs one workload and returns the result: config, server info, per-request records
    and the summary (with the run's speculative decoding when the server speculates)."""
    from shiftjax.serving.bench.load_generator import run_load

    workload = workload or build_workload(config)
    slos = metrics.parse_goodput(config.goodput)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    async with make_backend(config) as backend:
        try:
            server_info = await backend.server_info()
        except Exception as error:  # info is a courtesy for the result file, not the run
            server_info = {"error": f"{type(error).__name__}: {error}"}
        warmed = await warm_up(backend, workload, config.warmup_requests)
        speculation_before = await read_speculation(backend)
        started_unix = time.time()  # to line the requests up with a server's step trace
        client_cpu = time.process_time()
        run = await run_load(backend, workload.requests, workload.prompts, workload.send_offsets,
                             max_concurrency=config.max_concurrency, progress=config.progress)
        client_cpu = time.process_time() - client_cpu
        speculation_after = await read_speculation(backend)
    records, duration = run.records, run.duration_s
    summary = metrics.summarize(records, duration, slos, config.percentiles)
    summary["prefix_cache"] |= best_hit_rate(config, workload, run, warmed)
    # One Python process parses every streamed chunk; near 1.0 the client, not the server,
    # may be what limits the run (and inflates ITL). With the server in the same process
    # (tests) this counts the server too.
    summary["client_cpu_fraction"] = client_cpu / duration
    if (speculative := run_speculation(speculation_before, speculation_after)) is not None:
        summary["speculative"] = speculative
    return {
        "label": config.label,
        "device": config.device,
        "started": started,
        "started_unix": started_unix,
        "config": dataclasses.asdict(config),
        "server_info": server_info,
        "summary": summary,
        "requests": [dataclasses.asdict(r) for r in records],
    }


def best_hit_rate(config: ServeBenchConfig, workload: Workload, run, warmed: list[int]) -> dict:
    """The best hit rate an LRU cache of ``config.cache_blocks`` blocks could reach on what
    was sent, in the order it was sent (the warm-up first, filling the cache, uncounted),
    counted over the completed requests as the measured rate is. A hash trace's blocks are
    its hash ids (partial last blocks included); other prompts' are their full blocks of
    ``config.cache_block_size`` tokens, which should be the server's page size."""
    order = warmed + run.sent_order
    prompts = [workload.prompts[i] for i in warmed] + [run.prompts[i] for i in run.sent_order]
    lengths = [len(p) for p in prompts]
    counted = [False] * len(warmed) + [run.records[i].success for i in run.sent_order]
    block = config.cache_block_size
    inserted = None
    if config.dataset == "hash-trace":
        chains = prefix_cache_bound.hash_id_chains([workload.requests[i].hash_ids for i in order], lengths, block)
    else:  # (answers are kept where a later turn's prompt holds them: multi-turn)
        answers = [None] * len(warmed) + [run.records[i].output_ids for i in run.sent_order]
        chains, inserted = prefix_cache_bound.served_token_chains(prompts, answers, block)
    return {"best_hit_rate": prefix_cache_bound.best_hit_rate(chains, lengths, config.cache_blocks, counted,
                                                              inserted),
            "block_size": block, "capacity_blocks": math.inf if config.cache_blocks is None else config.cache_blocks}


async def read_speculation(backend) -> SpeculationReading | None:
    """The server's speculative decoding counters now; None when it does not say or cannot
    be read (a courtesy of the report, as the server info is, not a reason to fail the run)."""
    try:
        return await backend.speculation()
    except Exception:  # noqa: BLE001 (gRPC's, httpx's and the parser's errors alike)
        return None


async def warm_up(backend, workload: Workload, count: int) -> list[int]:
    """Sends the first ``count`` requests of the workload that follow no other, one after
    another, and forgets them: first-use costs on either side (connections, allocator, lazy
    set-up) stay out of the measurement. Returns their indices. A warm-up that fails stops
    the run, since the server is not right."""
    chosen = [i for i, request in enumerate(workload.requests) if request.previous is None][:max(count, 0)]
    for index in chosen:
        request = workload.requests[index]
        record = metrics.RequestRecord(index=-1, prompt_len=request.prompt_len, output_len=request.output_len)
        await backend.generate(record, workload.prompts[index])
        if not record.success:
            raise ConnectionError(f"the warm-up request failed: {record.error}")
    return chosen


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say what to send and when (shared with ``bench compare``)."""
    parser.add_argument("--backend", choices=BACKENDS, default="grpc")
    parser.add_argument("--dataset", choices=DATASETS, default="random",
                        help="hash-trace: a JSONL trace with hash_ids; shared-prefix: --num-prompts prompts of one "
                             "--prefix-len prefix and their own --suffix-len suffix; multi-turn: --conversations "
                             "chats of --turns turns, each turn the last prompt, its answer and --turn-len new tokens")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"requests (random, shared-prefix: default {DEFAULT_RANDOM_PROMPTS}; a trace: at most "
                             "this many; multi-turn: not used)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths uniform in [L*(1-r), L*(1+r)]")
    parser.add_argument("--trace", help="an Azure trace CSV or a JSONL trace (timestamp ms, input_length, output_length)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply trace times by this (0.1: 10x faster)")
    parser.add_argument("--start", type=float, default=0.0, help="seconds of trace time to skip")
    parser.add_argument("--duration", type=float, default=None, help="seconds of trace time to replay")
    parser.add_argument("--max-input-len", type=int, default=None, help="clip trace prompts to this many tokens")
    parser.add_argument("--max-output-len", type=int, default=None, help="clip trace outputs to this many tokens")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per hash id of a hash-trace (default 512), and per block of the best prefix-cache "
                             f"hit rate the report shows (other datasets: default {DEFAULT_CACHE_BLOCK}, give the "
                             "server's page size)")
    parser.add_argument("--cache-blocks", type=int, default=None,
                        help="the cache capacity, in blocks, of that best hit rate (default: infinite)")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="shared-prefix: the shared prefix's tokens; multi-turn: a system prompt all chats share")
    parser.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: each prompt's own tokens")
    parser.add_argument("--conversations", type=int, default=8, help="multi-turn: chats, started on the arrival process")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per chat, each sent when the last ends")
    parser.add_argument("--turn-len", type=int, default=128, help="multi-turn: tokens of each new user message")
    parser.add_argument("--cache-salt", default=None,
                        help="sent with every request: the server shares cached prompt pages within one salt only")
    parser.add_argument("--json-schema", default=None, metavar="SCHEMA_OR_FILE",
                        help="sent with every request (structured outputs): inline JSON or a file")
    parser.add_argument("--disable-speculation", action="store_true",
                        help="sent with every request: none speculates on a server that speculates (the baseline "
                             "of a speculative run against the same server)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (inf: all at once); multi-turn: conversations per second")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="send this many of the workload's requests one at a time first, unrecorded")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated, as numpy.percentile takes them")
    parser.add_argument("--tokenizer", help="a directory with tokenizer.json: prompts avoid its special tokens")
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt ids from [0, N) instead of a tokenizer")
    parser.add_argument("--model", help="the model name for the openai backend (default: the first of /v1/models)")
    parser.add_argument("--api-key-file")
    parser.add_argument("--no-progress", action="store_true")


def _schema_text(value: str | None) -> str | None:
    """``--json-schema``'s JSON text: the value itself when it is JSON, else the file it names."""
    if value is None or value.lstrip().startswith("{"):
        return value
    try:
        return Path(value).read_text()
    except OSError as error:
        raise SystemExit(f"--json-schema: cannot read {value!r} ({error.strerror})") from None


def config_from_args(args: argparse.Namespace, server: str) -> ServeBenchConfig:
    return ServeBenchConfig(
        server=server, backend=args.backend, dataset=args.dataset, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio, trace=args.trace,
        time_scale=args.time_scale, start=args.start, duration=args.duration,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len, block_size=args.block_size,
        cache_blocks=args.cache_blocks, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        conversations=args.conversations, turns=args.turns, turn_len=args.turn_len, cache_salt=args.cache_salt,
        json_schema=_schema_text(args.json_schema), disable_speculation=args.disable_speculation,
        request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        warmup_requests=args.warmup_requests, goodput=args.goodput,
        percentiles=[float(p) for p in args.percentiles.split(",")], tokenizer=args.tokenizer,
        vocab_size=args.vocab_size, model=args.model, api_key_file=args.api_key_file,
        label=getattr(args, "label", None), device=getattr(args, "device", None), progress=not args.no_progress,
    )


def serve_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shiftjax bench serve",
                                     description="Benchmark a running server with vLLM's serving metrics.")
    parser.add_argument("--server", required=True, metavar="HOST:PORT",
                        help="gRPC address, or the HTTP address with --backend openai")
    add_workload_arguments(parser)
    parser.add_argument("--label", help="a name for this run in the result file")
    parser.add_argument("--device", help='what the server ran on, e.g. "2x H200"; recorded in the result file')
    parser.add_argument("--result-file", help="write the result (config, requests, summary) as JSON here")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, args.server)
        result = asyncio.run(run_serve_bench(config))
    except (ValueError, ConnectionError) as error:
        print(f"shiftjax bench serve: {error}", file=sys.stderr)
        return 2
    print_summary_table(result)
    if args.result_file:
        write_json(result, args.result_file)
    return 0 if result["summary"]["completed"] > 0 else 1
