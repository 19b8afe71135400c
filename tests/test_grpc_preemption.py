"""A real gRPC server over a page pool small enough to preempt: concurrent streams still get
exactly the greedy tokens each prompt gets alone, and ServerInfo shows the preemptions
happened and that every page came back."""

import asyncio

from grpc_harness import ServerThread
from test_service import CONFIG, CharTokenizer

from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.client.grpc_client import AsyncClient
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.server.service import AsyncEngineService
from shiftjax.weights import shard_params

# 6 requests x (40 prompt + 20 output) tokens need 90 pages of 4 together; the pool has 31.
PROMPTS = [[(7 * i + j) % 90 + 3 for j in range(40)] for i in range(6)]
MAX_TOKENS = 20


def test_streams_under_preemption_equal_each_prompt_alone():
    weights = shard_params(random_params(CONFIG, seed=5, scale=0.3), CONFIG, make_mesh(2, 2))
    engine = Engine(weights, EngineConfig(max_model_len=64, page_size=4, max_num_seqs=6, max_num_batched_tokens=16,
                                          token_buckets=(8, 16), seq_buckets=(8,), attention="reference",
                                          mode="alternate", num_pages=32))
    alone = []
    for prompt in PROMPTS:  # unbatched: one request at a time, never preempted
        [request] = [engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
        engine.run_until_done([request])
        alone.append(request.output_ids)
    assert engine.scheduler.num_preemptions == 0

    service = AsyncEngineService(engine, CharTokenizer(), model_name="tiny")
    server = ServerThread(service)
    try:
        async def together():
            async with AsyncClient(server.address, timeout=120.0) as client:
                completions = await asyncio.gather(*(
                    client.complete(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
                    for p in PROMPTS))
                return completions, await client.info()

        completions, info = asyncio.run(together())
    finally:
        server.stop()
        service.shutdown()
    assert [list(c.token_ids) for c in completions] == alone
    assert all(c.finish_reason == "length" for c in completions)
    assert info.preemptions >= 1, "the pool was meant to be too small for all six at once"
    assert info.free_pages == info.num_pages == 31
