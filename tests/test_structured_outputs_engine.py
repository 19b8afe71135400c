"""Structured outputs in the engine, on the CPU meshes: a crowded batch mixing constrained,
unconstrained and sampled rows, with chunked prefill and preemption, generates in every mode
exactly what greedy decoding of transformers' logits masked by the same grammars generates;
a constraint that allows every token changes nothing; sampled constrained rows keep to
their grammar; and the grammar's end, max_tokens and bad constraints end or refuse a
request as they should."""

import json
import re

import jax
import pytest
from structured_tiny import CONFIG, EOS, masked_greedy, tiny_compiler, tiny_tokenizer
from test_parallel import transformers_model

from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.grammar import GrammarCompiler, GrammarState, check_grammar
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.structured_outputs import StructuredOutputs
from shiftjax.weights import shard_params

# 4-token pages, 16 tokens a step (the longer prompts are chunked), 12 usable pages for up to
# four sequences of up to 40 tokens each: page pressure preempts
OPTIONS = dict(max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(4, 16),
               seq_buckets=(4,), attention="reference", num_pages=13, enable_prefix_caching=False)
ALLOW_ALL = StructuredOutputs(grammar="start: /(?s:.*)/")
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["ab", "cd"]}},
          "required": ["id", "tag"], "additionalProperties": False}
CONSTRAINTS = [
    StructuredOutputs(regex="[a-f]{3}-[0-9]{2,4}"),
    StructuredOutputs.from_json_schema(SCHEMA),
    StructuredOutputs(choice=("yes", "no", "maybe so")),
    None,
    ALLOW_ALL,
    StructuredOutputs(json_object=True),
    StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[0-9]+/'),
    StructuredOutputs(regex="[A-Z][a-z]+( [A-Z][a-z]+)*"),
]


def prompts() -> list[list[int]]:
    text = ["Give me the code, now:", "A record, in JSON:", "Yes or no?", "Hello there",
            "Hello there", "An object:", "A tuple of numbers:", "Name a person"]
    return [tiny_tokenizer().encode(t).ids for t in text]


def params_for(constraint, max_tokens=24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=constraint)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=11, scale=0.3)


@pytest.fixture(scope="module")
def expected(params):
    model, compiler = transformers_model(params, CONFIG), tiny_compiler()
    return [masked_greedy(model, compiler, p, params_for(c)) for p, c in zip(prompts(), CONSTRAINTS)]


def generate(engine: Engine, constraints=CONSTRAINTS, sampling=None):
    requests = [engine.add_request(p, sampling(c) if sampling else params_for(c)) for p, c in zip(prompts(), constraints)]
    engine.run_until_done(requests)
    assert not engine.has_work
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1
    return requests


def engine_on(params, sp, tp, **options) -> Engine:
    weights = shard_params(params, CONFIG, make_mesh(sp, tp, jax.devices()[:sp * tp]))
    return Engine(weights, EngineConfig(**OPTIONS | options), eos_token_ids=(EOS,), grammar_compiler=tiny_compiler())


@pytest.mark.slow
@pytest.mark.parametrize("sp, tp, mode, async_scheduling", [
    (2, 2, "tp", True), (2, 2, "sp", True), (2, 2, "alternate", True), (2, 2, "auto", True),
    (2, 2, "alternate", False), (2, 4, "alternate", True)])
def test_constrained_greedy_equals_masked_argmax_reference(params, expected, sp, tp, mode, async_scheduling):
    engine = engine_on(params, sp, tp, mode=mode, async_scheduling=async_scheduling,
                       **({"shift_threshold": 8} if mode == "auto" else {}))
    requests = generate(engine)
    got = [(r.output_ids, r.finish_reason) for r in requests]
    assert got == expected
    assert engine.scheduler.num_preemptions > 0  # the pool is tight enough to preempt
    grammar = engine.snapshot().grammar
    assert grammar.mask_fills > 0 and grammar.masked_rows >= sum(len(o) for o, _ in expected[:3])
    assert grammar.compiles == len(CONSTRAINTS) - 1 and grammar.mask_seconds > 0
    # the constraint that allows every token generates what no constraint does
    assert got[4] == got[3]  # the same prompt
    # what the grammars demand
    text = [tiny_tokenizer().decode(o) for o, _ in got]
    for (output, reason), line in zip(got, text):
        assert reason in ("stop", "length")
    if got[0][1] == "stop":
        assert re.fullmatch("[a-f]{3}-[0-9]{2,4}", text[0])
    if got[1][1] == "stop":
        record = json.loads(text[1])
        assert set(record) == {"id", "tag"} and record["tag"] in ("ab", "cd")
    assert got[2][1] == "stop" and text[2] in ("yes", "no", "maybe so")


@pytest.mark.slow
def test_sampled_constrained_rows_keep_to_their_grammar(params):
    engine = engine_on(params, 2, 2, mode="alternate")
    compiler = engine.grammar_compiler
    for seed in range(3):
        requests = generate(engine, sampling=lambda c: SamplingParams(
            max_tokens=24, temperature=1.3, top_p=0.95, seed=seed, structured_outputs=c))
        for request, constraint in zip(requests, CONSTRAINTS):
            assert request.finish_reason in ("stop", "length")
            if constraint is None:
                continue
            # the tokens replay through a fresh matcher: every one was allowed
            state = GrammarState(compiler.compile(constraint))
            for token in request.output_ids:
                if token == EOS:
                    break
                assert state.accept(token), (constraint, request.output_ids, state.error)
        choice = tiny_tokenizer().decode(requests[2].output_ids)
        assert requests[2].finish_reason == "stop" and choice in ("yes", "no", "maybe so")


def test_grammar_end_and_max_tokens_end_a_request(params):
    engine = engine_on(params, 1, 1, mode="tp")
    done = engine.add_request(prompts()[0], params_for(StructuredOutputs(regex="[a-f]{3}"), max_tokens=10))
    # a schema whose shortest instance needs more tokens than max_tokens allows: "length"
    cut = engine.add_request(prompts()[1], params_for(StructuredOutputs.from_json_schema(SCHEMA), max_tokens=5))
    engine.run_until_done([done, cut])
    assert done.finish_reason == "stop" and len(done.output_ids) == 3
    assert cut.finish_reason == "length" and len(cut.output_ids) == 5


@pytest.mark.parametrize("constraint, field", [
    (StructuredOutputs(regex="[0-9"), "structured_outputs.regex"),
    (StructuredOutputs(json='{"type": "frobnicate"}'), "structured_outputs.json"),
    (StructuredOutputs(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_it(params, constraint, field):
    engine = engine_on(params, 1, 1, mode="tp")
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request(prompts()[0], params_for(constraint))
    assert refused.value.field == field
    assert not engine.has_work
    with pytest.raises(InvalidRequest) as checked:  # the command line's check, with no tokenizer
        check_grammar(constraint)
    assert checked.value.field == field and "does not compile" in str(checked.value)


@pytest.mark.parametrize("fields, named", [
    ({}, "structured_outputs"), ({"regex": "a", "choice": ("a",)}, "structured_outputs"),
    ({"regex": ""}, "structured_outputs.regex"), ({"choice": ()}, "structured_outputs.choice"),
    ({"choice": ("a", "")}, "structured_outputs.choice"), ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
])
def test_malformed_structured_outputs_name_the_field(fields, named):
    with pytest.raises(InvalidRequest) as refused:
        StructuredOutputs(**fields)
    assert refused.value.field == named


def test_an_engine_without_a_grammar_compiler_refuses_constraints(params):
    weights = shard_params(params, CONFIG, make_mesh(1, 1, jax.devices()[:1]))
    engine = Engine(weights, EngineConfig(**OPTIONS | {"mode": "tp"}), eos_token_ids=(EOS,))
    with pytest.raises(InvalidRequest, match="without a tokenizer") as refused:
        engine.add_request(prompts()[0], params_for(StructuredOutputs(regex="a")))
    assert refused.value.field == "structured_outputs"


def test_compiled_grammars_are_cached_and_bounded():
    compiler = GrammarCompiler(tiny_tokenizer().to_str(), CONFIG.vocab_size, (EOS,), max_cached=2)
    a, b, c = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+"))
    assert compiler.compile(a) is compiler.compile(StructuredOutputs(regex="a+"))
    compiler.compile(b), compiler.compile(c)  # a is the least recently used: evicted
    assert (compiler.compiles, compiler.cache_hits) == (3, 1)
    compiler.compile(a)
    assert compiler.compiles == 4


def test_a_deferred_sampling_that_fails_recomputes_its_requests(params, expected, monkeypatch):
    """The sampler of a step whose masks waited fails once: advance reports it, its requests
    recompute, and every output is still the reference's; an interrupt there leaves no
    unsampled step in flight."""
    engine = engine_on(params, 2, 2, mode="tp")
    sample_deferred, calls, failing_calls = engine.runner.sample_deferred, [], [3, 6]

    def failing(launched, bitmask, error):
        calls.append(error)
        if len(calls) in failing_calls:
            raise error
        return sample_deferred(launched, bitmask)

    monkeypatch.setattr(engine.runner, "sample_deferred",
                        lambda launched, bitmask: failing(launched, bitmask, RuntimeError("injected")))
    requests = [engine.add_request(p, params_for(c)) for p, c in zip(prompts(), CONSTRAINTS)]
    failures = []
    while not all(r.finished for r in requests):
        turn = engine.step()
        failures += turn.failed
    assert len(failures) == 2 and all(isinstance(f.__cause__, RuntimeError) for f in failures)
    assert [(r.output_ids, r.finish_reason) for r in requests] == expected
    while engine.has_work:
        engine.step()
    monkeypatch.setattr(engine.runner, "sample_deferred",
                        lambda launched, bitmask: failing(launched, bitmask, KeyboardInterrupt()))
    calls.clear()
    failing_calls[:] = [3]
    requests = [engine.add_request(p, params_for(c)) for p, c in zip(prompts(), CONSTRAINTS)]
    with pytest.raises(KeyboardInterrupt):
        while True:
            engine.step()
    assert engine.runner.last_launched is None or engine.runner.last_launched.sampled
    while not all(r.finished for r in requests):  # usable after the interrupt
        engine.step()
    assert [(r.output_ids, r.finish_reason) for r in requests] == expected


def test_a_grammar_given_compiled_is_used_as_is(params):
    engine = engine_on(params, 1, 1, mode="tp")
    constraint = StructuredOutputs(regex="[a-f]{3}")
    compiled = engine.compile_grammar(params_for(constraint))
    compiles = engine.grammar_compiler.compiles
    request = engine.add_request(prompts()[0], params_for(constraint, max_tokens=10), grammar=compiled)
    engine.run_until_done([request])
    assert request.finish_reason == "stop" and len(request.output_ids) == 3
    assert engine.grammar_compiler.compiles == compiles
    with pytest.raises(ValueError, match="not the request's"):
        engine.add_request(prompts()[0], params_for(StructuredOutputs(regex="x")), grammar=compiled)


def test_an_end_of_sequence_from_a_failed_grammar_is_an_error_not_a_stop():
    from shiftjax.serving.engine.scheduler import Scheduler, SchedulerConfig

    class Failed:
        failed, terminated = True, False

        def accept(self, token):
            return True

    class Refusing(Failed):
        failed = False

        def accept(self, token):
            return False

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32, page_size=4,
                                          num_pages=16))
    ended = scheduler.add([5, 6, 7], params_for(ALLOW_ALL), (EOS,), grammar=Failed())
    refused = scheduler.add([5, 6, 7], params_for(ALLOW_ALL), (EOS,), grammar=Refusing())
    step = scheduler.schedule()
    scheduler.commit(step, [EOS, 9], [0.0, 0.0], "tp")
    assert (ended.finish_reason, refused.finish_reason) == ("error", "error")


def test_a_schema_dict_keeps_its_property_order():
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    assert list(json.loads(StructuredOutputs.from_json_schema(schema).json)["properties"]) == ["zeta", "alpha"]


def test_end_of_sequence_ids_the_tokenizer_lacks_are_left_out():
    """A model config's EOS id beyond another model's tokenizer (dummy weights beside the
    default tokenizer) does not stop grammars from compiling."""
    from shiftjax.checkpoints.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_tokenizer(), special_tokens={"eos_token": "</s>"})
    compiler = GrammarCompiler.for_tokenizer(tokenizer, 128, (EOS, 120))
    assert compiler.eos_token_ids == (EOS,)
    state = GrammarState(compiler.compile(StructuredOutputs(regex="ab")))
    assert state.accept(tiny_tokenizer().token_to_id("a")) and not state.terminated
