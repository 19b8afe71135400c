"""``shiftjax serve``: one process serving the engine over gRPC and, when asked, the
OpenAI-compatible HTTP API and Prometheus metrics.

Start-up order: the gRPC port opens first with health ``NOT_SERVING`` (so orchestrators
see a live process while executables compile), the service is built on a thread, then
health turns ``SERVING`` and the HTTP and metrics ports open. SIGTERM or SIGINT drains
(:func:`_drain`): the ports keep listening, health says ``NOT_SERVING`` (HTTP: 503 with
``Retry-After``), new requests are refused, running ones are given ``--grace-seconds`` (a
second signal ends the grace at once) and then end with an abort finish reason; then exit 0.

What a client may send is bounded, so that one hostile client cannot stall the others:
``--max-request-bytes`` for an HTTP body and a gRPC message alike, ``--read-timeout`` for
HTTP headers and bodies, and the parsing, tokenizing and chat-template rendering of both
front ends run on ``--tokenize-workers`` threads, never on the event loop that answers
health checks and streams tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from shiftjax.serving.engine.xla_allocator import GPU_ALLOCATORS, use_gpu_allocator

log = logging.getLogger("shiftjax.serve")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    from shiftjax.serving.server.tool_calls import PARSERS

    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    group.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    group.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (off unless given)")
    group.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics port (off unless given)")
    group.add_argument("--tool-call-parser", choices=tuple(PARSERS), default=None,
                       help="HTTP: read tool calls out of the text (<tool_call>{...}</tool_call>, as Qwen2.5 and "
                            "Hermes templates write them) for tool_choice 'auto'; without it 'auto' is refused "
                            "('required' and a named function need none)")
    group.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: TLS on the gRPC and HTTP ports")
    group.add_argument("--tls-key", type=Path, default=None, help="PEM private key: TLS on the gRPC and HTTP ports")
    group.add_argument("--max-request-bytes", type=int, default=None, metavar="BYTES",
                       help="the largest request either front end reads: an HTTP body (413 past it, refused on its "
                            "Content-Length or as it streams) and a gRPC message (RESOURCE_EXHAUSTED); default 4 MiB")
    group.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="HTTP: a request's headers, and then its body, must each arrive within this (the "
                            "connection is closed, or the request answered 408)")
    group.add_argument("--tokenize-workers", type=int, default=2,
                       help="threads that parse, tokenize and render chat templates for both front ends, off the "
                            "event loop that serves health checks and streams")
    group.add_argument("--api-key-file", type=Path, default=None,
                       help="a file holding the bearer token both front ends require")
    group.add_argument("--grace-seconds", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, how long running requests may take to finish "
                            "(a second signal ends the wait)")
    group.add_argument("--served-model-name", default=None, help="the model name both front ends report")
    group.add_argument("--gpu-allocator", choices=GPU_ALLOCATORS, default="default",
                       help="JAX's GPU memory allocator: default (BFC), or vmm, under which XLA stopped "
                            "re-recording every CUDA graph of a step in stretches of decode steps "
                            "(serving/engine/xla_allocator.py); under vmm the KV cache is sized from the "
                            "driver's free memory")
    group.add_argument("--dp", type=int, default=1, metavar="P",
                       help="data parallel: P engines of one device each (devices 0..P-1) behind this one endpoint, "
                            "each with its own prefix cache, each request routed to the engine with the least "
                            "work queued once the prompt tokens it holds cached are taken off; needs --sp 1 --tp 1")


def _parser() -> argparse.ArgumentParser:
    from shiftjax.serving.engine.engine_args import add_engine_arguments

    parser = argparse.ArgumentParser(prog="shiftjax serve", description="Serve a model over gRPC (and HTTP).")
    add_engine_arguments(parser)
    add_server_arguments(parser)
    return parser


def _build_service(args, observer):
    """The integration point with serving/server/service_args.py: the engine service the parsed
    engine options describe, with ``observer`` receiving its events. Runs on a thread."""
    from shiftjax.serving.server.service_args import build_data_parallel_service, build_service

    if args.dp > 1:
        return build_data_parallel_service(args, observer=observer)
    return build_service(args, observer=observer)


def _read_secrets(parser, args) -> tuple[tuple[bytes, bytes] | None, str | None]:
    """TLS files and the API key, read before anything slow starts so a typo fails at once."""
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    try:
        tls = (args.tls_cert.read_bytes(), args.tls_key.read_bytes()) if args.tls_cert else None
        api_key = args.api_key_file.read_text().strip() if args.api_key_file else None
    except OSError as error:
        parser.error(str(error))
    if args.api_key_file and not api_key:
        parser.error(f"--api-key-file {args.api_key_file} is empty")
    return tls, api_key


def serve_main(argv: list[str]) -> int:
    from shiftjax.serving.engine.engine_args import engine_arguments_error
    from shiftjax.serving.server.service_args import data_parallel_error

    parser = _parser()
    args = parser.parse_args(argv)
    if error := engine_arguments_error(args) or data_parallel_error(args):
        parser.error(error)
    tls, api_key = _read_secrets(parser, args)
    # Our own lines at INFO; libraries (absl via orbax logs every restore step) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("shiftjax").setLevel(logging.INFO)
    try:
        use_gpu_allocator(args.gpu_allocator)
        return asyncio.run(_serve(args, tls, api_key))
    except (OSError, RuntimeError) as error:  # a port in use; the engine failed to start
        log.error("%s", error)
        return 1


async def _serve(args, tls, api_key) -> int:
    from shiftjax.serving.server.grpc_server import GrpcServer
    from shiftjax.serving.server.metrics import Metrics
    from shiftjax.serving.server.tokenize_pool import TokenizePool
    from shiftjax.serving.server.validation import DEFAULT_MAX_REQUEST_BYTES

    loop = asyncio.get_running_loop()
    stop, stop_now = asyncio.Event(), asyncio.Event()  # the first signal drains, a second ends the grace

    def on_signal() -> None:
        (stop_now if stop.is_set() else stop).set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)

    max_request_bytes = args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
    pool = TokenizePool(workers=args.tokenize_workers)  # both front ends' parsing and tokenizing
    grpc_server = GrpcServer(host=args.host, port=args.port, tls=tls, api_key=api_key,
                             max_message_bytes=max_request_bytes, pool=pool)
    await grpc_server.start()
    scheme = "TLS" if tls else "plaintext"
    log.info("gRPC listening on %s (%s%s); health NOT_SERVING until the executables are ready",
             grpc_server.address, scheme, ", bearer token required" if api_key else "")

    metrics = Metrics()
    started = time.monotonic()
    try:
        service = await _build_or_stop(args, metrics, stop)
    except Exception as error:  # noqa: BLE001 - a bad tokenizer path, an unusable mesh...: say so, exit 1
        log.error("start-up failed: %s: %s", type(error).__name__, error)
        await grpc_server.server.stop(0)
        return 1
    if service is not None:
        if args.served_model_name:  # one name on both front ends
            service.model_name = args.served_model_name
        grpc_server.attach(service)  # health turns SERVING by itself once the service is ready
    if service is None or not await _ready_or_stop(service, stop):
        log.info("stopped during start-up")
        if service is not None:
            service.shutdown()
        await grpc_server.server.stop(0)
        return 0
    metrics.bind_stats(service.stats)
    _log_startup(service, time.monotonic() - started)

    http_server = http_task = metrics_server = None
    if args.http_port is not None:
        from shiftjax.serving.server.body_limits import HttpLimits
        from shiftjax.serving.server.http_server import create_app, uvicorn_server

        limits = HttpLimits(max_request_bytes=max_request_bytes, read_timeout_seconds=args.read_timeout)
        app = create_app(service, model_name=service.model_name, api_key=api_key, metrics=metrics,
                         limits=limits, pool=pool, tool_call_parser=args.tool_call_parser)
        http_server = uvicorn_server(app, host=args.host, port=args.http_port,
                                     tls_files=(args.tls_cert, args.tls_key) if tls else None)
        http_task = loop.create_task(http_server.serve())
        while not http_server.started and not http_task.done():
            await asyncio.sleep(0.05)
        if http_task.done():  # uvicorn failed to bind; it logged why
            raise OSError(f"cannot serve HTTP on {args.host}:{args.http_port}")
        log.info("serving OpenAI-compatible HTTP on %s://%s:%d/v1 (requests up to %d bytes)",
                 "https" if tls else "http", args.host, args.http_port, max_request_bytes)
    if args.metrics_port is not None:
        from shiftjax.serving.server.metrics import start_metrics_server

        metrics_server, _ = start_metrics_server(metrics, args.metrics_port, args.host)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", args.host, metrics_server.server_port)
    log.info("serving gRPC on %s (shiftjax.v1.InferenceService, health, reflection)", grpc_server.address)
    await stop.wait()

    await _drain(service, grpc_server, http_server, args.grace_seconds, stop_now)
    if http_task is not None:
        await asyncio.gather(http_task, return_exceptions=True)
    if metrics_server is not None:
        metrics_server.shutdown()
    service.shutdown()
    pool.shutdown()
    log.info("stopped")
    return 0


# After the grace, how long the aborted streams have to reach their clients (an abort takes
# effect at the engine thread's next pass, after the step it is in: seconds on a loaded CPU).
ABORT_DELIVERY_SECONDS = 15.0


async def _drain(service, grpc_server, http_server, grace_seconds: float, stop_now: asyncio.Event) -> None:
    """SIGTERM's drain, which clients can see: both ports keep listening, health answers
    NOT_SERVING (gRPC) and 503 with Retry-After (HTTP), new requests UNAVAILABLE / 503;
    running requests get ``grace_seconds``, which a second SIGTERM or SIGINT ends at once;
    then the service aborts the rest, so every stream ends with an abort finish
    (``finish_reason: "abort"`` and ``[DONE]`` on SSE, ``FINISH_REASON_ABORT`` on gRPC)
    rather than a cut connection; only then do the ports close."""
    log.info("draining: health NOT_SERVING, new requests refused, %.0f s for running ones "
             "(a second signal ends the grace)", grace_seconds)
    await grpc_server.begin_drain()
    aborted = await service.drain(grace_seconds, cut_short=stop_now)  # its draining flag turns HTTP /health 503
    if stop_now.is_set():
        log.info("a second signal: the grace ends now")
    if aborted:
        log.warning("%d requests were still running after the grace period; their streams end with an abort",
                    aborted)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + ABORT_DELIVERY_SECONDS
    left = await grpc_server.wait_for_streams(ABORT_DELIVERY_SECONDS)
    while http_server is not None and _http_requests(http_server) and loop.time() < give_up:
        await asyncio.sleep(0.02)
    if left or (http_server is not None and _http_requests(http_server)):
        log.warning("streams still open %.0f s after their aborts; closing them", ABORT_DELIVERY_SECONDS)
    if http_server is not None:
        http_server.config.timeout_graceful_shutdown = 1
        http_server.should_exit = True
    await grpc_server.server.stop(0.5)


def _http_requests(http_server) -> int:
    """HTTP requests uvicorn is still answering (a finished stream's task is gone)."""
    return len(http_server.server_state.tasks)


async def _build_or_stop(args, observer, stop: asyncio.Event):
    """The service, or None when a signal came first. The build runs on a daemon thread:
    compiling cannot be interrupted, and a stop during start-up should not wait for it."""
    built = asyncio.get_running_loop().create_future()

    def build():
        try:
            service = _build_service(args, observer)
            built.get_loop().call_soon_threadsafe(lambda: built.done() or built.set_result(service))
        except BaseException as error:  # noqa: BLE001 (re-raised on the loop)
            # bound now: Python unbinds ``error`` when the except block ends, before the loop
            # runs the callback (which then raised NameError and the server waited forever)
            built.get_loop().call_soon_threadsafe(lambda failure=error: built.done() or built.set_exception(failure))

    threading.Thread(target=build, name="build-service", daemon=True).start()
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([built, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    return built.result() if built.done() else None


async def _ready_or_stop(service, stop: asyncio.Event) -> bool:
    """Waits until the service's executables are ready (True) or a signal comes (False);
    the gRPC server already answers meanwhile (health NOT_SERVING, Generate UNAVAILABLE)."""
    while not service.wait_ready(0):  # raises what the engine's start-up raised
        if stop.is_set():
            return False
        await asyncio.sleep(0.1)
    return True


def _log_startup(service, seconds: float) -> None:
    info = service.info()  # layout: serving/server/service_info.py
    mesh, pool, startup = info.get("mesh", {}), info.get("page_pool", {}), info.get("startup", {})
    where = (f"{mesh['dp']} data-parallel replicas of one {mesh.get('platform')} device each" if mesh.get("dp")
             else f"an sp {mesh.get('sp')} x tp {mesh.get('tp')} mesh of {mesh.get('devices')} {mesh.get('platform')} "
                  f"devices")
    log.info("model %s on %s; modes %s, policy %s; ready in %.1f s", info.get("model"), where,
             ",".join(info.get("modes", ())), info.get("policy", {}).get("name"), seconds)
    log.info("executables: %s, %s loaded from the compilation cache, %.1f s compiling", startup.get("executables"),
             startup.get("cache_hits"), float(startup.get("compile_seconds") or 0.0))
    log.info("page pool: %s pages of %s tokens, %s free (%s)", pool.get("num_pages"), pool.get("page_size"),
             pool.get("free_pages"), pool.get("explanation") or pool.get("sized_by"))
    if (speculative := info.get("speculative") or {}).get("enabled"):
        limit = speculative.get("disable_by_batch_size")
        log.info("speculative decoding: %s, drafts of up to %s tokens, %s", speculative.get("method"),
                 speculative.get("num_speculative_tokens"),
                 f"none in steps with more than {limit} running requests" if limit else "at any batch size")
