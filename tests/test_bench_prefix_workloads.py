"""Prefix-caching workloads of the bench: hash-id traces, a shared prefix, multi-turn chats,
the best hit rate an LRU cache could reach, and the report's hit rate and per-turn TTFT.
Against the fake server, which plays an infinite cache of full blocks when asked."""

import json

import numpy as np
import pytest

from shiftjax.serving.bench.cli import bench_main
from shiftjax.serving.bench.compare import WorkloadSpec, planned_runs
from shiftjax.serving.bench.prefix_cache_bound import (
    best_hit_rate,
    hash_id_chains,
    token_chains,
    trace_best_hit_rate,
)
from shiftjax.serving.bench.prefix_workloads import (
    hash_id_blocks,
    hash_trace_prompts,
    id_digits,
    multi_turn_requests,
    shared_prefix_prompts,
    shared_prefix_requests,
)
from shiftjax.serving.bench.report import summary_lines
from shiftjax.serving.bench.serve_bench import ServeBenchConfig, build_workload
from shiftjax.serving.bench.workloads import TraceRow, WorkloadRequest, allowed_token_ids, read_trace
from test_bench_load_generator import fake_server_process, run_against_fake


def write_trace(path, rows):
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + "\n"
                            for t, n, o, ids in rows))
    return path


def test_equal_hash_ids_give_equal_blocks_and_distinct_ids_distinct_ones():
    allowed = allowed_token_ids(7, special_ids=[0, 6])  # 5 tokens: ids up to 5**3 need 3 digits
    ids = np.arange(125)
    digits = id_digits(int(ids.max()), allowed.size)
    assert digits == 3
    blocks = hash_id_blocks(ids, 8, allowed, seed=0, digits=digits)
    assert blocks.shape == (125, 8) and set(blocks.ravel()) <= set(allowed.tolist())
    assert len({tuple(b) for b in blocks}) == 125  # no two ids collide, even on 5 tokens
    again = hash_id_blocks([124, 3, 3], 8, allowed, seed=0, digits=digits)
    assert (again[0] == blocks[124]).all() and (again[1] == blocks[3]).all() and (again[2] == blocks[3]).all()
    assert not (hash_id_blocks([3], 8, allowed, seed=1, digits=digits)[0] == blocks[3]).all()  # the seed's noise
    with pytest.raises(ValueError, match="block-size 2"):
        hash_id_blocks(ids, 2, allowed, 0, digits)


def test_hash_trace_prompts_share_exactly_the_blocks_of_shared_ids():
    requests = [WorkloadRequest(12, 1, hash_ids=(7, 8, 9)), WorkloadRequest(10, 1, hash_ids=(7, 8, 10)),
                WorkloadRequest(6, 1, hash_ids=(9, 7)), WorkloadRequest(3, 1, hash_ids=(7,))]
    first, second, third, fourth = hash_trace_prompts(requests, 4, allowed_token_ids(1000), seed=0)
    assert [len(p) for p in (first, second, third, fourth)] == [12, 10, 6, 3]
    assert first[:8] == second[:8] and first[8:9] != second[8:9]  # id 9 vs id 10
    assert third[:4] == first[8:12] and third[4:6] == first[:2]  # an id is the same block anywhere
    assert fourth == first[:3]  # a partial block is the head of the full one


def test_hash_trace_replays_lengths_arrivals_and_reaches_the_best_hit_rate(tmp_path):
    trace = write_trace(tmp_path / "hash.jsonl", [
        (0, 12, 2, [0, 1, 2]), (100, 11, 2, [0, 1, 3]), (300, 3, 2, [5]), (200, 16, 2, [0, 1, 2, 4])])
    rows = read_trace(trace)
    assert [row.hash_ids for row in rows] == [(0, 1, 2), (0, 1, 3), (0, 1, 2, 4), (5,)]  # by time
    # by hand: the second hits ids 0 1 (8 tokens), the third 0 1 2 (12); 20 of 42 prompt tokens
    assert trace_best_hit_rate(rows, None, block_size=4) == pytest.approx(20 / 42)
    result, engine, workload = run_against_fake(dict(dataset="hash-trace", trace=str(trace), block_size=4),
                                                engine_kwargs={"cache_block_size": 4})
    records = result["requests"]
    assert [(r["prompt_len"], r["output_tokens"]) for r in records] == [(12, 2), (11, 2), (16, 2), (3, 2)]
    assert [r["scheduled_at"] for r in records] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert sorted(map(len, (r["prompt_ids"] for r in engine.requests))) == [3, 11, 12, 16]
    assert [r["cached_tokens"] for r in records] == [0, 8, 12, 0]
    cache = result["summary"]["prefix_cache"]
    assert cache["hit_rate"] == pytest.approx(20 / 42) and cache["best_hit_rate"] == pytest.approx(20 / 42)
    assert cache["block_size"] == 4
    # the bound on the prompts' tokens agrees with the one on their hash ids (full blocks here)
    lengths = [len(p) for p in workload.prompts]
    assert best_hit_rate(token_chains(workload.prompts, 4), lengths, None) == pytest.approx(20 / 42)


def test_a_hash_trace_with_the_wrong_block_size_is_refused(tmp_path):
    trace = write_trace(tmp_path / "hash.jsonl", [(0, 1000, 2, [0, 1])])
    assert build_workload(ServeBenchConfig(server="", dataset="hash-trace", trace=str(trace), vocab_size=100)).prompts
    with pytest.raises(ValueError, match="block-size 256 it would have 4"):
        build_workload(ServeBenchConfig(server="", dataset="hash-trace", trace=str(trace), block_size=256,
                                        vocab_size=100))
    no_ids = tmp_path / "plain.jsonl"
    no_ids.write_text('{"timestamp": 0, "input_length": 8, "output_length": 1}\n')
    with pytest.raises(ValueError, match="no hash_ids"):
        build_workload(ServeBenchConfig(server="", dataset="hash-trace", trace=str(no_ids), vocab_size=100))


# Blocks of 4 tokens; chains a = [1], b = [1 2], c = [1 2 3], d = [1 2 4'] (4' a 2-token
# partial block), e = [1 5]. Prompt tokens 12 + 10 + 8 + 12 + 10 = 52.
HAND_TRACE = [TraceRow(0.0, 12, 1, (1, 2, 3)), TraceRow(1.0, 10, 1, (1, 2, 4)), TraceRow(2.0, 8, 1, (1, 5)),
              TraceRow(3.0, 12, 1, (1, 2, 3)), TraceRow(4.0, 10, 1, (1, 2, 4))]


@pytest.mark.parametrize("capacity, hits", [
    (None, 0 + 8 + 4 + 12 + 10),  # everything seen stays
    # 3 blocks, LRU -> MRU: A leaves c b a; B hits a b, then d b a (c out); C hits a, then b e a;
    # D hits a b (c is gone), then c b a; E hits a b (d is gone)
    (3, 0 + 8 + 4 + 8 + 8),
    (1, 0 + 4 + 4 + 4 + 4),  # a request's first block is its most recent: the root stays
    (0, 0),
])
def test_best_hit_rate_by_hand(capacity, hits):
    assert trace_best_hit_rate(HAND_TRACE, capacity, block_size=4) == pytest.approx(hits / 52)


def test_a_partial_block_equals_only_a_partial_block_of_its_length():
    chains = hash_id_chains([(1, 2), (1, 2), (1, 2)], [8, 6, 6], 4)
    assert chains[0].keys[1] != chains[1].keys[1] and chains[1].keys == chains[2].keys
    assert chains[1].tokens == (4, 2)
    with pytest.raises(ValueError, match="needs 3 hash ids"):
        hash_id_chains([(1, 2)], [9], 4)


def test_shared_prefix_prompts_share_exactly_the_prefix():
    requests = shared_prefix_requests(50, 6, 3, 2)
    prompts = shared_prefix_prompts(requests, 6, allowed_token_ids(60), np.random.default_rng(0))
    assert all(len(p) == 9 for p in prompts)
    assert all(p[:6] == prompts[0][:6] for p in prompts)
    assert len({p[6] for p in prompts}) == 50  # so no two share a 7th token
    with pytest.raises(ValueError, match="distinct first tokens"):
        shared_prefix_prompts(shared_prefix_requests(61, 6, 3, 2), 6, allowed_token_ids(60), np.random.default_rng(0))
    with pytest.raises(ValueError, match="prefix-len"):
        shared_prefix_requests(4, 0, 3, 2)


def test_shared_prefix_against_the_fake_cache():
    result, engine, _ = run_against_fake(dict(dataset="shared-prefix", num_prompts=5, prefix_len=9, suffix_len=3,
                                              output_len=2, block_size=4), engine_kwargs={"cache_block_size": 4})
    assert all(len(r["prompt_ids"]) == 12 for r in engine.requests)
    cache = result["summary"]["prefix_cache"]
    # the 9-token prefix holds 2 full blocks: 4 of the 5 prompts find them
    assert cache["cached_prompt_tokens"] == 4 * 8 and cache["hit_rate"] == pytest.approx(32 / 60)
    assert cache["best_hit_rate"] == pytest.approx(32 / 60)


def test_multi_turn_requests_chain_conversation_by_conversation():
    requests = multi_turn_requests(2, 3, 5, 2, prefix_len=4)
    assert [(r.conversation, r.turn, r.previous) for r in requests] == [
        (0, 0, None), (0, 1, 0), (0, 2, 1), (1, 0, None), (1, 1, 3), (1, 2, 4)]
    assert [r.prompt_len for r in requests[:3]] == [9, 16, 23]  # + answer 2 + message 5 each turn


@pytest.mark.parametrize("http", [False, True], ids=["grpc", "openai"])
def test_multi_turn_prompts_extend_the_last_prompt_and_its_answer(http):
    result, engine, workload = run_against_fake(
        dict(dataset="multi-turn", conversations=2, turns=3, turn_len=5, output_len=3, prefix_len=4, block_size=4,
             cache_salt="tenant"), http=http, engine_kwargs={"cache_block_size": 4})
    records = result["requests"]
    assert all(r["success"] for r in records), [r["error"] for r in records]
    assert {r["cache_salt"] for r in engine.requests} == {"tenant"}
    sent = {tuple(r["prompt_ids"]) for r in engine.requests}
    for conversation in range(2):
        turns = [r for r in records if r["conversation"] == conversation]
        assert [r["turn"] for r in turns] == [0, 1, 2]
        prompt = list(workload.prompts[turns[0]["index"]])
        for before, turn in zip(turns, turns[1:]):
            answer = [1000 + (len(prompt) + i) % 1000 for i in range(3)]  # the fake's answer to that prompt
            assert before["output_ids"] == answer
            prompt = prompt + answer + workload.prompts[turn["index"]]
            assert tuple(prompt) in sent and turn["prompt_len"] == len(prompt)
            assert turn["sent_at"] >= before["sent_at"] + before["e2el"]  # one turn at a time
        assert prompt[:4] == workload.prompts[0][:4]  # the system prompt all chats share
    summary = result["summary"]
    assert len(summary["ttft_by_turn"]) == 3 and all(s["median_ms"] > 0 for s in summary["ttft_by_turn"])
    # both chats share the first block (the system prompt); each turn has its last prompt's full blocks
    assert summary["prefix_cache"]["hit_rate"] > 0.3
    assert summary["prefix_cache"]["hit_rate"] == pytest.approx(summary["prefix_cache"]["best_hit_rate"])


def test_a_failed_turn_fails_the_rest_of_its_conversation_unsent():
    chat = dict(dataset="multi-turn", conversations=1, turns=3, turn_len=4, output_len=2)
    result, engine, _ = run_against_fake(chat, http=True, engine_kwargs={"http_token_ids": False})
    errors = [r["error"] for r in result["requests"]]
    assert "return_token_ids" in errors[0] and all("not sent" in e for e in errors[1:])
    assert len(engine.requests) == 1 and result["summary"]["failed"] == 3


def test_report_shows_the_hit_rates_and_ttft_per_turn():
    result = {"label": None, "config": {"backend": "grpc", "dataset": "multi-turn", "request_rate": "inf",
                                        "burstiness": 1.0, "max_concurrency": None},
              "summary": {"completed": 4, "failed": 0, "duration_s": 1.0, "total_input_tokens": 100,
                          "total_output_tokens": 8, "request_throughput": 4.0, "request_goodput": None,
                          "output_throughput": 8.0, "total_token_throughput": 108.0,
                          **{name: {"mean_ms": 1.0, "median_ms": 1.0, "std_ms": 0.0} for name in
                             ("ttft", "tpot", "itl", "e2el")},
                          "prefix_cache": {"cached_prompt_tokens": 40, "hit_rate": 0.4, "best_hit_rate": 0.41,
                                           "block_size": 16, "capacity_blocks": "inf"},
                          "ttft_by_turn": [{"median_ms": 30.0}, {"median_ms": 12.5}]}}
    text = "\n".join(summary_lines(result))
    assert "Measured hit rate (%):" in text and "40.00" in text
    assert "Best LRU hit rate (%), inf x 16-tok:" in text and "41.00" in text and "-1.00" in text
    assert "Turn 0 median TTFT (ms):" in text and "Turn 1 median TTFT (ms):" in text and "12.50" in text
    assert "inf chats/s" in text


def test_cli_flags_run_a_multi_turn_chat_and_print_the_report(tmp_path, capsys):
    from loopback import free_port

    port = free_port()
    out = tmp_path / "result.json"
    with fake_server_process(["--port", str(port), "--token-delay", "0.002", "--cache-block-size", "4"], port):
        code = bench_main(["serve", "--server", f"127.0.0.1:{port}", "--dataset", "multi-turn", "--conversations", "2",
                           "--turns", "3", "--turn-len", "6", "--output-len", "2", "--prefix-len", "8",
                           "--block-size", "4", "--cache-blocks", "100", "--cache-salt", "s", "--vocab-size", "500",
                           "--no-progress", "--result-file", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "Best LRU hit rate (%), 100 x 4-tok:" in table and "Turn 2 median TTFT (ms):" in table
    result = json.loads(out.read_text())
    assert result["config"]["cache_salt"] == "s" and result["summary"]["completed"] == 6
    assert result["summary"]["prefix_cache"]["hit_rate"] > 0


def test_compare_specs_take_the_prefix_workloads_and_salt_each_rate():
    spec = WorkloadSpec.from_dict({"name": "prefix", "dataset": "shared-prefix", "prefix_len": 8, "suffix_len": 2,
                                   "num_prompts": 3, "output_len": 1, "cache_salt": "x", "request_rates": [2, "inf"]})
    chat = WorkloadSpec.from_dict({"name": "chat", "dataset": "multi-turn", "conversations": 2, "turns": 2,
                                   "turn_len": 3, "output_len": 1})
    runs = planned_runs([spec, chat], {"vocab_size": 100})
    assert [config.cache_salt for _, _, config, _ in runs] == ["x@2", "x@inf", None]
    assert all(p[:8] == runs[0][3].prompts[0][:8] for p in runs[0][3].prompts)
    assert [r.previous for r in runs[2][3].requests] == [None, 0, None, 2]


def test_the_committed_synthetic_trace_is_what_its_generator_writes(tmp_path):
    """benchmarks/traces/synthetic_reuse.jsonl is reproducible, and its reuse is the 61.5%
    benchmarks/README.md and the H200 run quote."""
    import subprocess
    import sys
    from pathlib import Path

    from shiftjax.serving.bench.prefix_cache_bound import trace_best_hit_rate
    from shiftjax.serving.bench.workloads import read_trace

    traces = Path(__file__).resolve().parents[1] / "benchmarks" / "traces"
    out = tmp_path / "trace.jsonl"
    subprocess.run([sys.executable, str(traces / "make_hash_trace.py"), "--out", str(out)], check=True,
                   capture_output=True)
    assert out.read_text() == (traces / "synthetic_reuse.jsonl").read_text()
    rows = read_trace(out)
    assert trace_best_hit_rate(rows, None) == trace_best_hit_rate(rows, 500) == pytest.approx(0.6154, abs=1e-4)
