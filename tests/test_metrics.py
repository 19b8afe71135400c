"""Metrics: known observer calls in, exact counts and sums out of the scraped text."""

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shiftjax.serving.engine.stats import EngineSnapshot
from shiftjax.serving.server.metrics import Metrics, start_metrics_server
from shiftjax.serving.server.protocol import EngineObserver, ServiceStats, Usage


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape, keyed by (name, sorted labels)."""
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def stats(ready: bool = True, draining: bool = False, **overrides) -> ServiceStats:
    """A service's stats: those of its engine snapshot's fields in ``overrides`` replaced."""
    fields = dict(running=3, waiting=5, num_pages=100, free_pages=75)
    return ServiceStats(EngineSnapshot(**(fields | overrides)), ready=ready, draining=draining)


def usage(prompt, output, queue, ttft, e2e) -> Usage:
    return Usage(prompt_tokens=prompt, output_tokens=output, queue_seconds=queue, ttft_seconds=ttft,
                 e2e_seconds=e2e, modes=("tp",) * output)


def test_metrics_has_exactly_the_observer_hooks_with_their_keywords():
    import inspect

    hooks = [name for name in vars(EngineObserver) if name.startswith("on_")]
    assert sorted(hooks) == ["on_finish", "on_preemption", "on_startup", "on_step", "on_token"]
    for name in hooks:
        assert inspect.signature(getattr(Metrics, name)) == inspect.signature(getattr(EngineObserver, name)), name


def test_request_latencies_and_token_counts():
    m = Metrics()
    m.on_token(first=True, seconds_since_previous=0.5)
    m.on_token(first=False, seconds_since_previous=0.03)
    m.on_token(first=False, seconds_since_previous=0.05)
    m.on_finish(usage=usage(7, 3, queue=0.25, ttft=0.5, e2e=0.9), finish_reason="length")
    m.on_token(first=True, seconds_since_previous=2.0)
    m.on_finish(usage=usage(11, 1, queue=1.5, ttft=2.0, e2e=2.0), finish_reason="stop")
    m.on_finish(usage=usage(4, 0, queue=0.0, ttft=0.0, e2e=0.1), finish_reason="abort")
    s = samples(m)

    assert s[("shiftjax_time_to_first_token_seconds_count", ())] == 2
    assert s[("shiftjax_time_to_first_token_seconds_sum", ())] == pytest.approx(2.5)
    assert s[("shiftjax_time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    assert s[("shiftjax_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert s[("shiftjax_inter_token_latency_seconds_count", ())] == 2
    assert s[("shiftjax_inter_token_latency_seconds_sum", ())] == pytest.approx(0.08)
    # TPOT only for the request with >= 2 output tokens: (0.9 - 0.5) / 2
    assert s[("shiftjax_time_per_output_token_seconds_count", ())] == 1
    assert s[("shiftjax_time_per_output_token_seconds_sum", ())] == pytest.approx(0.2)
    assert s[("shiftjax_request_queue_time_seconds_count", ())] == 3
    assert s[("shiftjax_request_queue_time_seconds_sum", ())] == pytest.approx(1.75)
    assert s[("shiftjax_e2e_request_latency_seconds_sum", ())] == pytest.approx(3.0)
    assert s[("shiftjax_prompt_tokens_total", ())] == 22
    assert s[("shiftjax_generation_tokens_total", ())] == 4
    assert s[("shiftjax_request_finished_total", (("finish_reason", "length"),))] == 1
    assert s[("shiftjax_request_finished_total", (("finish_reason", "stop"),))] == 1
    assert s[("shiftjax_request_finished_total", (("finish_reason", "abort"),))] == 1


def test_steps_by_mode_switches_preemptions_and_startup():
    m = Metrics()
    m.on_startup(compile_seconds=12.5, executables=8, cache_hits=6)
    m.on_step(mode="tp", num_tokens=1, num_seqs=1, seconds=0.01, switched=False)
    m.on_step(mode="sp", num_tokens=300, num_seqs=4, seconds=0.2, switched=True)
    m.on_step(mode="sp", num_tokens=4, num_seqs=4, seconds=0.03, switched=False)
    m.on_step(mode="tp", num_tokens=2, num_seqs=2, seconds=0.02, switched=True)
    m.on_preemption()
    m.on_preemption()
    s = samples(m)

    assert s[("shiftjax_steps_total", (("mode", "tp"),))] == 2
    assert s[("shiftjax_steps_total", (("mode", "sp"),))] == 2
    assert s[("shiftjax_step_tokens_total", (("mode", "sp"),))] == 304
    assert s[("shiftjax_step_tokens_total", (("mode", "tp"),))] == 3
    assert s[("shiftjax_step_duration_seconds_sum", (("mode", "sp"),))] == pytest.approx(0.23)
    assert s[("shiftjax_step_duration_seconds_count", (("mode", "tp"),))] == 2
    assert s[("shiftjax_step_batch_tokens_bucket", (("le", "256.0"), ("mode", "sp")))] == 1
    assert s[("shiftjax_step_batch_tokens_bucket", (("le", "512.0"), ("mode", "sp")))] == 2
    assert s[("shiftjax_mode_switches_total", ())] == 2
    assert s[("shiftjax_preemptions_total", ())] == 2
    assert s[("shiftjax_startup_compile_seconds", ())] == 12.5
    assert s[("shiftjax_startup_executables", ())] == 8
    assert s[("shiftjax_startup_compilation_cache_hits", ())] == 6


def test_gauges_are_read_from_stats_at_every_scrape():
    current = {"stats": stats()}
    m = Metrics()
    assert ("shiftjax_num_requests_running", ()) not in samples(m)  # not bound: absent, not zero
    m.bind_stats(lambda: current["stats"])
    s = samples(m)
    assert s[("shiftjax_num_requests_running", ())] == 3
    assert s[("shiftjax_num_requests_waiting", ())] == 5
    assert s[("shiftjax_kv_pages", ())] == 100
    assert s[("shiftjax_kv_pages_free", ())] == 75
    assert s[("shiftjax_kv_page_utilization", ())] == 0.25
    assert s[("shiftjax_ready", ())] == 1

    current["stats"] = stats(running=0, waiting=0, free_pages=100, draining=True)
    s = samples(m)
    assert s[("shiftjax_num_requests_running", ())] == 0
    assert s[("shiftjax_kv_page_utilization", ())] == 0
    assert s[("shiftjax_ready", ())] == 0
    assert s[("shiftjax_draining", ())] == 1


def test_prefix_cache_counters_and_pages_are_read_from_stats_at_every_scrape():
    current = {"stats": stats(prefix_cache_queries=120, prefix_cache_hits=48, cached_pages=6, evicted_pages=2)}
    m = Metrics(stats=lambda: current["stats"])
    s = samples(m)
    assert s[("shiftjax_prefix_cache_queries_total", ())] == 120  # tokens, as vLLM counts them
    assert s[("shiftjax_prefix_cache_hits_total", ())] == 48
    assert s[("shiftjax_prefix_cache_pages", ())] == 6
    assert s[("shiftjax_prefix_cache_evicted_pages_total", ())] == 2
    current["stats"] = stats(prefix_cache_queries=200, prefix_cache_hits=80, cached_pages=4, evicted_pages=5)
    s = samples(m)
    assert (s[("shiftjax_prefix_cache_queries_total", ())], s[("shiftjax_prefix_cache_hits_total", ())]) == (200, 80)
    assert (s[("shiftjax_prefix_cache_pages", ())], s[("shiftjax_prefix_cache_evicted_pages_total", ())]) == (4, 5)
    text = m.render().decode()
    assert "# TYPE shiftjax_prefix_cache_hits_total counter" in text
    assert "# TYPE shiftjax_prefix_cache_pages gauge" in text


def test_structured_output_counters_are_read_from_stats_at_every_scrape():
    from shiftjax.serving.engine.stats import GrammarCounters

    current = {"stats": stats(grammar=GrammarCounters(mask_fills=10, masked_rows=64, mask_seconds=0.012,
                                                      compiles=3, cache_hits=5, compile_seconds=0.004))}
    m = Metrics(stats=lambda: current["stats"])
    s = samples(m)
    assert s[("shiftjax_structured_output_mask_fills_total", ())] == 10
    assert s[("shiftjax_structured_output_masked_rows_total", ())] == 64
    assert s[("shiftjax_structured_output_mask_seconds_total", ())] == 0.012
    assert s[("shiftjax_structured_output_grammars_compiled_total", ())] == 3
    assert s[("shiftjax_structured_output_grammar_cache_hits_total", ())] == 5
    current["stats"] = stats(grammar=GrammarCounters(mask_fills=11, compiles=4))
    s = samples(m)
    assert (s[("shiftjax_structured_output_mask_fills_total", ())],
            s[("shiftjax_structured_output_grammars_compiled_total", ())]) == (11, 4)
    # replicas' counters add up (--dp)
    assert GrammarCounters(mask_fills=1, mask_seconds=0.5) + GrammarCounters(mask_fills=2, compiles=1) == \
        GrammarCounters(mask_fills=3, mask_seconds=0.5, compiles=1)


def test_speculative_decoding_counters_are_read_from_stats_at_every_scrape():
    from shiftjax.serving.engine.speculative import SpecDecodeCounters

    current = {"stats": stats(speculative=SpecDecodeCounters(num_drafts=40, num_draft_tokens=120,
                                                             num_accepted_tokens=70,
                                                             accepted_per_position=(35, 22, 13), draft_seconds=0.25))}
    m = Metrics(stats=lambda: current["stats"])
    s = samples(m)
    assert s[("shiftjax_spec_decode_num_drafts_total", ())] == 40
    assert s[("shiftjax_spec_decode_num_draft_tokens_total", ())] == 120
    assert s[("shiftjax_spec_decode_num_accepted_tokens_total", ())] == 70
    assert s[("shiftjax_spec_decode_draft_seconds_total", ())] == 0.25
    per_position = {labels: value for (name, labels), value in s.items()
                    if name == "shiftjax_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_position == {(("position", "0"),): 35, (("position", "1"),): 22, (("position", "2"),): 13}
    assert "# TYPE shiftjax_spec_decode_num_accepted_tokens_per_pos_total counter" in m.render().decode()
    current["stats"] = stats(speculative=SpecDecodeCounters(num_drafts=41, num_draft_tokens=123,
                                                            num_accepted_tokens=72, accepted_per_position=(36, 23, 13)))
    s = samples(m)
    assert (s[("shiftjax_spec_decode_num_drafts_total", ())],
            s[("shiftjax_spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))]) == (41, 23)


def test_an_engine_that_does_not_speculate_shows_zeros_and_no_positions():
    s = samples(Metrics(stats=stats))
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "draft_seconds"):
        assert s[(f"shiftjax_spec_decode_{name}_total", ())] == 0, name
    assert not [key for key in s if key[0] == "shiftjax_spec_decode_num_accepted_tokens_per_pos_total"]


def test_a_failing_stats_call_leaves_the_rest_of_the_scrape():
    m = Metrics(stats=lambda: 1 / 0)
    m.on_preemption()
    s = samples(m)
    assert s[("shiftjax_preemptions_total", ())] == 1
    assert ("shiftjax_num_requests_running", ()) not in s


def test_two_instances_share_nothing():
    a, b = Metrics(), Metrics()
    a.on_preemption()
    assert samples(a)[("shiftjax_preemptions_total", ())] == 1
    assert samples(b)[("shiftjax_preemptions_total", ())] == 0


def test_metrics_server_on_its_own_port():
    m = Metrics(stats=stats)
    m.on_step(mode="sp", num_tokens=5, num_seqs=1, seconds=0.5, switched=False)
    server, thread = start_metrics_server(m, 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for path in ("/", "/metricsx", "/admin"):  # this port serves /metrics alone
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}{path}", timeout=10)
            assert caught.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
    assert 'shiftjax_steps_total{mode="sp"} 5.0' not in text  # steps, not tokens
    assert 'shiftjax_steps_total{mode="sp"} 1.0' in text
    assert "shiftjax_num_requests_waiting 5.0" in text
