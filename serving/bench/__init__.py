"""The benchmark client: ``shiftjax bench serve`` and ``shiftjax bench compare``.

``bench serve`` sends one workload to a running server and reports vLLM's serving metrics
(``metrics.py`` states the definitions)::

    shiftjax bench serve --server 127.0.0.1:50051 --backend grpc \\
        --dataset random --input-len 4096 --output-len 250 --num-prompts 256 \\
        --request-rate 8 --burstiness 0.5 --max-concurrency 256 --seed 0 \\
        --goodput ttft:500 tpot:50 --device "2x H200" --result-file run.json

    shiftjax bench serve --server 127.0.0.1:8000 --backend openai \\
        --dataset trace --trace benchmarks/traces/azure2023_code.csv \\
        --start 600 --duration 1800 --time-scale 0.1

``bench compare`` starts each deployment (a ``shiftjax serve`` command line), waits for
gRPC health SERVING, runs the same seeded workloads, stops it with SIGTERM, and writes
``compare.json``, ``compare.md`` and the plots::

    shiftjax bench compare --deployments deployments.json --workloads workloads.json \\
        --out-dir compare_x2 --device "2x H200"

    deployments.json: {"device": "2x H200", "deployments": [
        {"name": "tp", "command": "shiftjax serve --sp 1 --tp 2 --port {port} --http-port {http_port} ..."},
        ...]}
    workloads.json: [
        {"name": "single", "input_len": 4096, "output_len": 250, "num_prompts": 8, "max_concurrency": 1},
        {"name": "sweep", "input_len": 4096, "output_len": 250, "num_prompts": 200,
         "request_rates": [1, 2, 4, 8, "inf"]},
        {"name": "azure code", "dataset": "trace", "trace": "benchmarks/traces/azure2023_code.csv",
         "time_scale": 0.05, "timeline": true}]

Workload keys are ``bench serve``'s options in snake_case; options given on the
``compare`` command line apply to every workload that does not set them. A workload with
``timeline`` (the default for a trace) polls ServerInfo during its run for the mode and
queue plot. ``shiftjax bench plot OUT/compare.json`` redraws the plots from a saved report.
"""
