"""What builds an :class:`AsyncEngineService`, or ``--dp`` replicas of one behind a
:class:`DataParallelService`, from ``shiftjax serve``'s arguments (the engine options are
``serving/engine/engine_args.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shiftjax.serving.engine.engine_args import build_llm, configure_jax, stderr_report


def build_service(args: argparse.Namespace, *, observer=None, report=stderr_report):
    """An :class:`AsyncEngineService` as the arguments describe. Configures JAX, then
    returns at once: weights load and executables compile on the service's engine thread
    (``service.ready`` / ``wait_ready()``; ``info()`` then says what was built)."""
    from shiftjax.checkpoints.load import load_tokenizer, tokenizer_path_for
    from shiftjax.serving.server.service import AsyncEngineService

    configure_jax(args)
    tokenizer = load_tokenizer(tokenizer_path_for(args.model, args.load_format, args.tokenizer))

    def build_engine():
        llm = build_llm(args, report=report)
        return llm.engine

    name = "default" if args.model == "default" else Path(args.model).name
    return AsyncEngineService(build_engine, tokenizer, model_name=name, observer=observer,
                              details={"load_format": args.load_format, "dtype": args.dtype,
                                       "weight_storage": args.weight_storage})


def data_parallel_error(args: argparse.Namespace) -> str | None:
    """Why ``--dp`` cannot run with the other arguments, or None: one check for the command
    line (a usage error) and for :func:`build_data_parallel_service` (a RuntimeError)."""
    if args.dp < 1:
        return f"--dp must be at least 1, got {args.dp}"
    if args.dp > 1 and args.sp * args.tp != 1:
        return (f"--dp {args.dp} runs engines of one device each and cannot be combined with "
                f"--sp {args.sp} --tp {args.tp}; give --sp 1 --tp 1 (or drop --dp for one sp x tp engine)")
    if args.dp > 1 and args.num_processes != 1:
        return "--dp runs its engines in one process; drop --num-processes/--coordinator"
    return None


def build_data_parallel_service(args: argparse.Namespace, *, observer=None, report=stderr_report):
    """``--dp P``: a :class:`DataParallelService` over P :class:`AsyncEngineService`
    replicas, replica ``i`` on ``jax.devices()[i]`` alone, each with the same engine
    options and a page pool of its own (``--num-pages`` is per replica). Returns at once;
    the replicas load and compile at the same time, each on its own engine thread."""
    import jax

    from shiftjax.checkpoints.load import load_tokenizer, tokenizer_path_for
    from shiftjax.serving.server.data_parallel import DataParallelService, StartupSummer
    from shiftjax.serving.server.service import AsyncEngineService

    if error := data_parallel_error(args):
        raise RuntimeError(error)
    configure_jax(args)
    devices = jax.devices()
    if len(devices) < args.dp:
        raise RuntimeError(f"--dp {args.dp} needs {args.dp} devices but JAX sees {len(devices)} "
                           f"({devices[0].platform}); lower --dp, or on the CPU give --cpu-devices {args.dp}")
    tokenizer = load_tokenizer(tokenizer_path_for(args.model, args.load_format, args.tokenizer))
    summed = StartupSummer(observer) if observer is not None else None
    if args.compile_workers is None:  # the replicas compile at the same time: share the CPUs
        from shiftjax.serving.engine.compile import compile_workers

        workers = max(1, compile_workers(devices[0].platform, args.gemm) // args.dp)
        args = argparse.Namespace(**{**vars(args), "compile_workers": workers})

    def build_engine(index: int):
        def replica_report(message: str) -> None:
            report(f"replica {index} ({devices[index]}): {message}")

        return lambda: build_llm(args, report=replica_report, devices=[devices[index]]).engine

    name = "default" if args.model == "default" else Path(args.model).name
    details = {"load_format": args.load_format, "dtype": args.dtype, "weight_storage": args.weight_storage}
    replicas = [AsyncEngineService(build_engine(i), tokenizer, model_name=name, observer=summed, details=details)
                for i in range(args.dp)]
    return DataParallelService(replicas, tokenizer, model_name=name,
                               devices=[str(devices[i]) for i in range(args.dp)])
