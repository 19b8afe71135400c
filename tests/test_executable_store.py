"""The executable store: a warm start loads compiled steps without tracing or lowering
them, runs them to the same tokens, and misses on any change to what the lowering
depends on; a damaged entry is compiled again, never trusted."""

import json
import shutil
import subprocess
import sys

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache
from subprocess_env import CPU_CODEGEN_FLAGS

from shiftjax.cache import CacheGeometry
from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine import compile as compiling
from shiftjax.serving.engine import executable_store
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.step_options import StepOptions
from shiftjax.weights import shard_params

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(2,))
PROMPTS = [[5, 17, 33, 8, 90, 41, 7, 12, 3, 66, 71], [9, 4], [30, 31, 32, 33, 34, 35]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
# (no prefix cache: the tests run the same prompts on one engine more than once and compare
# log-probabilities bit for bit, which K/V computed in another step's batch need not keep)
OPTIONS = dict(max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
               token_buckets=(4, 16), seq_buckets=(4,), attention="reference", mode="alternate",
               enable_prefix_caching=False)


@pytest.fixture(scope="module", autouse=True)
def without_the_compilation_cache():
    """The store keeps only what XLA just compiled (serving/engine/compile.py says why), so
    these tests run without the test run's persistent compilation cache (conftest.py), whose
    hits would leave the store empty."""
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def weights():
    return shard_params(random_params(CONFIG, seed=5, scale=0.3), CONFIG, make_mesh(2, 1))


@pytest.fixture
def lowered_steps(monkeypatch):
    """Every step the engine traced and lowered (a store hit lowers nothing)."""
    seen = []
    lower = compiling._lower_steps

    def counting(weights, caches, steps, *args, **kwargs):
        seen.extend(steps)
        return lower(weights, caches, steps, *args, **kwargs)

    monkeypatch.setattr(compiling, "_lower_steps", counting)
    return seen


@pytest.fixture(scope="module")
def cold_store(weights, tmp_path_factory):
    """A store one cold engine filled, and that engine: tests that start from a filled store
    copy it (``filled_store``) rather than each compiling the same steps again."""
    store = tmp_path_factory.mktemp("cold") / "store"
    engine = Engine(weights, EngineConfig(**OPTIONS, executable_store=str(store)))
    assert engine.executables.loaded_from_store == 0
    return store, engine


@pytest.fixture
def filled_store(cold_store, tmp_path):
    """A copy of ``cold_store``'s entries, this test's to change: (its path, the cold engine)."""
    store = tmp_path / "store"
    shutil.copytree(cold_store[0], store)
    return store, cold_store[1]


def step_entries(store):
    return sorted(p for p in store.glob("*.executable") if not p.name.startswith("sampler-"))


def tokens(engine):
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.run_until_done(requests)
    return [r.output_ids for r in requests], [m for r in requests for m in r.modes]


def test_a_warm_start_loads_every_step_and_runs_it_the_same(weights, tmp_path, lowered_steps):
    store = str(tmp_path / "store")
    cold = Engine(weights, EngineConfig(**OPTIONS, executable_store=store))
    assert cold.executables.loaded_from_store == 0 and len(lowered_steps) == 4  # 2 modes x 2 buckets
    assert len(step_entries(tmp_path / "store")) == 4
    # one sequence bucket, two samplers (sample_rows, greedy_rows)
    assert len(list((tmp_path / "store").glob("sampler-*.executable"))) == 2
    lowered_steps.clear()

    warm = Engine(weights, EngineConfig(**OPTIONS, executable_store=store))
    assert lowered_steps == [] and warm.executables.loaded_from_store == 4
    assert (cold.samplers.loaded_from_store, warm.samplers.loaded_from_store) == (0, 2)
    # start-up phases, for the log and ServerInfo: only a warm start checks stored steps
    assert list(cold.startup_seconds) == ["kv_cache", "executables", "samplers"]
    assert list(warm.startup_seconds) == ["kv_cache", "executables", "check_stored", "samplers"]
    assert all(seconds > 0 for seconds in warm.startup_seconds.values())
    assert set(warm.executables.compiled) == set(cold.executables.compiled)
    cold_tokens, cold_modes = tokens(cold)
    warm_tokens, warm_modes = tokens(warm)
    assert warm_tokens == cold_tokens and all(len(t) == GREEDY.max_tokens for t in warm_tokens)
    assert {"tp", "sp"} <= set(warm_modes) and warm_modes == cold_modes  # both modes' loaded steps ran

    # the loaded steps still donate the caches: the engine's old cache buffers are gone
    old = warm.caches.k
    tokens(warm)
    assert old.is_deleted()


def test_any_change_to_what_the_lowering_depends_on_is_a_miss(weights, filled_store, lowered_steps, monkeypatch):
    store = str(filled_store[0])
    # a step option: the result width
    narrower = Engine(weights, EngineConfig(**OPTIONS | {"max_top_logprobs": 0}, executable_store=store))
    assert narrower.executables.loaded_from_store == 0 and len(lowered_steps) == 4
    lowered_steps.clear()
    # the rows of every step's result (the largest sequence bucket), even for a step of the same bucket
    wider = Engine(weights, EngineConfig(**OPTIONS | {"seq_buckets": (4, 8), "max_num_seqs": 8},
                                         executable_store=store))
    assert wider.executables.loaded_from_store == 0 and ("tp", 4, 4) in lowered_steps
    lowered_steps.clear()
    # the package's source
    monkeypatch.setattr(executable_store, "source_fingerprint", lambda: "an edited kernel")
    edited = Engine(weights, EngineConfig(**OPTIONS, executable_store=store))
    assert edited.executables.loaded_from_store == 0 and len(lowered_steps) == 4
    monkeypatch.undo()

    import jax

    key = dict(mode="tp", num_tokens=4, num_seqs=4)
    options = StepOptions(max_pages=16, attention="reference", layer_loop="scan", max_top_logprobs=20)
    caches = narrower.caches
    base = executable_store.step_key(weights, caches, options, **key)
    assert executable_store.step_key(weights, caches, options, **key) == base  # stable
    with jax.default_matmul_precision("bfloat16"):  # JAX configuration, even a thread-local one (conftest: highest)
        assert executable_store.step_key(weights, caches, options, **key) != base
    other_mesh = shard_params(random_params(CONFIG, seed=5, scale=0.3), CONFIG, make_mesh(1, 2))
    assert executable_store.step_key(other_mesh, caches, options, **key) != base
    assert executable_store.step_key(weights, caches, options, **key | {"num_seqs": 1}) != base


def test_a_damaged_entry_is_compiled_again(weights, filled_store, lowered_steps):
    store = filled_store[0]
    victim = step_entries(store)[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    lowered_steps.clear()
    messages = []
    engine = Engine(weights, EngineConfig(**OPTIONS, executable_store=str(store)), report=messages.append)
    assert engine.executables.loaded_from_store == 3 and len(lowered_steps) == 1
    assert any(victim.name in m and "not loaded" in m for m in messages), messages
    assert all(len(t) == GREEDY.max_tokens for t in tokens(engine)[0])
    lowered_steps.clear()
    assert Engine(weights, EngineConfig(**OPTIONS, executable_store=str(store))).executables.loaded_from_store == 4
    # a whole, valid entry of another step under this step's name: its header names the other key
    first, second = step_entries(store)[:2]
    second.write_bytes(first.read_bytes())
    messages.clear()
    engine = Engine(weights, EngineConfig(**OPTIONS, executable_store=str(store)), report=messages.append)
    assert engine.executables.loaded_from_store == 3
    assert any(second.name in m and "does not match" in m for m in messages), messages


CHILD = """
import json, sys, jax
jax.config.update("jax_num_cpu_devices", 2)
store, xla_cache = sys.argv[1], sys.argv[2]
if xla_cache:
    jax.config.update("jax_compilation_cache_dir", xla_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.weights import shard_params
config = ModelConfig(**%(config)r)
weights = shard_params(random_params(config, seed=5, scale=0.3), config, make_mesh(2, 1))
engine = Engine(weights, EngineConfig(**%(options)r, executable_store=store))
requests = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in %(prompts)r]
engine.run_until_done(requests)
print(json.dumps([engine.executables.loaded_from_store, engine.executables.cache_hits,
                  [r.output_ids for r in requests]]))
""" % {"config": CONFIG.__dict__, "options": OPTIONS, "prompts": PROMPTS}


def child(store, xla_cache=""):
    """A fresh process's engine on the store: (loaded from it, XLA cache hits, tokens)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(store), str(xla_cache)], capture_output=True,
                          text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "XLA_FLAGS": CPU_CODEGEN_FLAGS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_stored(tmp_path):
    """The key must not depend on anything of one process (addresses, ids, hash seeds)."""
    loaded, _, cold_tokens = child(tmp_path / "store")
    assert loaded == 0
    loaded, _, warm_tokens = child(tmp_path / "store")
    assert loaded == 4 and warm_tokens == cold_tokens


def test_an_executable_from_the_compilation_cache_is_not_stored(tmp_path):
    """One that JAX loaded from its persistent cache and that was serialized again loads but
    fails when run ("Function ... not found"): only fresh compiles are stored."""
    store, xla = tmp_path / "store", tmp_path / "xla"
    loaded, hits, cold_tokens = child(store, xla)
    assert (loaded, hits) == (0, 0) and len(step_entries(store)) == 4
    assert len(list(store.glob("sampler-*.executable"))) == 2
    for entry in store.glob("*.executable"):
        entry.unlink()
    loaded, hits, tokens = child(store, xla)  # every step from the XLA cache: none stored
    assert (loaded, hits) == (0, 4) and tokens == cold_tokens and not list(store.glob("*.executable"))
    loaded, hits, tokens = child(store, xla)  # so nothing stale to load: it runs
    assert (loaded, hits) == (0, 4) and tokens == cold_tokens


def test_a_stored_executable_that_fails_when_run_is_compiled_again(weights, filled_store, lowered_steps, monkeypatch):
    """Loading is not enough (an executable re-serialized from JAX's cache loaded and then
    failed on its first call): the engine runs every stored step once at start."""
    store, cold = str(filled_store[0]), filled_store[1]

    class Broken:
        def __call__(self, *args):
            raise RuntimeError("NOT_FOUND: Function wrapped_iota not found")

    load = executable_store.ExecutableStore.load
    victims = []

    def load_one_broken(self, key, devices, report=None):  # the same entry, every time it is loaded
        if not victims:
            victims.append(key)
        return Broken() if key == victims[0] else load(self, key, devices, report)

    monkeypatch.setattr(executable_store.ExecutableStore, "load", load_one_broken)
    messages = []
    engine = Engine(weights, EngineConfig(**OPTIONS, executable_store=store), report=messages.append)
    assert any("failed when run" in m and "wrapped_iota" in m for m in messages), messages
    assert engine.executables.loaded_from_store == 3 and len(lowered_steps) == 1
    assert not any(isinstance(e, Broken) for e in engine.executables.compiled.values())
    assert list(engine.executables.compiled) == list(cold.executables.compiled)  # ladder order kept
    assert tokens(engine)[0] == tokens(cold)[0]


def test_a_stored_sampler_samples_as_compiled_and_one_that_fails_is_compiled_again(weights, filled_store, monkeypatch):
    """Samplers are stored too (a warm start compiles nothing); one loaded from the store
    samples what the compiled one does, and one that fails when run is compiled again."""
    store, cold = str(filled_store[0]), filled_store[1]
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=11, logprobs=True, top_logprobs=2)

    def samples(engine):
        requests = [engine.add_request(p, sampled) for p in PROMPTS]
        engine.run_until_done(requests)
        return [(r.output_ids, r.output_top_logprobs) for r in requests]

    warm = Engine(weights, EngineConfig(**OPTIONS, executable_store=store))
    assert warm.samplers.loaded_from_store == 2
    assert samples(warm) == samples(cold)

    class Broken:
        def __call__(self, *args):
            raise RuntimeError("NOT_FOUND: Function wrapped_sort not found")

    load = executable_store.ExecutableStore.load
    monkeypatch.setattr(executable_store.ExecutableStore, "load", lambda self, key, devices, report=None:
                        Broken() if key.startswith("sampler-") else load(self, key, devices, report))
    messages = []
    engine = Engine(weights, EngineConfig(**OPTIONS, executable_store=store), report=messages.append)
    assert any("sampler failed when run" in m and "wrapped_sort" in m for m in messages), messages
    assert engine.samplers.loaded_from_store == 0 and engine.executables.loaded_from_store == 4
    assert not any(isinstance(e, Broken) for e in engine.samplers.compiled.values())
    assert samples(engine) == samples(cold)


def test_the_temporaries_size_is_measured_once_then_read(weights, tmp_path, lowered_steps):
    """Sizing the page pool from memory compiles the largest steps to learn their
    temporaries; with a store, a warm start reads that size instead, and a change of any
    option the steps depend on, or a damaged entry, measures it again."""
    store = executable_store.ExecutableStore(tmp_path / "store")
    caches = CacheGeometry(CONFIG.num_layers, weights.layout.kv_slots, 4, CONFIG.head_dim, "float32").abstract(
        weights.mesh)
    ladder = BucketLadder((4, 16), (4,))
    options = StepOptions(max_pages=16, attention="reference", layer_loop="scan", max_top_logprobs=2)

    def measure(**changes):
        return compiling.temporary_bytes(weights, caches, ladder, ("tp", "sp"), options.replace(**changes),
                                         store=store)

    size = measure()
    assert lowered_steps == [("tp", 16, 4), ("sp", 16, 4)] and size == compiling.temporary_bytes(
        weights, caches, ladder, ("tp", "sp"), options)
    [entry] = (tmp_path / "store").glob("temporaries-*.json")
    lowered_steps.clear()
    assert measure() == size and lowered_steps == []  # read, not compiled
    measure(max_top_logprobs=0)
    assert lowered_steps == [("tp", 16, 4), ("sp", 16, 4)]  # another step, another entry
    assert len(list((tmp_path / "store").glob("temporaries-*.json"))) == 2
    lowered_steps.clear()
    entry.write_text('{"format": 1, "key": "other", "value": 5}')
    assert measure() == size and lowered_steps == [("tp", 16, 4), ("sp", 16, 4)]
    entry.write_text("{not json")
    lowered_steps.clear()
    assert measure() == size and len(lowered_steps) == 2
    assert json.loads(entry.read_text())["value"] == size  # replaced


def test_an_engine_sized_from_memory_starts_warm_without_compiling(weights, tmp_path, lowered_steps, monkeypatch):
    """With no page count given, the engine sizes its pool from device memory, which needs
    the steps' temporaries: the cold start compiles the largest steps for them, a warm start
    reads them from the store and, its pool the same size, loads every step."""
    from shiftjax.serving.engine import page_budget as page_pool

    monkeypatch.setattr(page_pool, "device_memory", lambda devices: (8 * 2**20, 2**20))  # the CPU keeps none
    store = str(tmp_path / "store")
    cold = Engine(weights, EngineConfig(**OPTIONS, executable_store=store))
    assert cold.page_pool.sized_by == "memory"
    assert lowered_steps[:2] == [("tp", 16, 4), ("sp", 16, 4)]  # the temporaries' probe, then the ladder
    lowered_steps.clear()
    warm = Engine(weights, EngineConfig(**OPTIONS, executable_store=store))
    assert warm.num_pages == cold.num_pages and lowered_steps == []
    assert warm.executables.loaded_from_store == len(warm.executables.compiled)
    assert tokens(warm) == tokens(cold)
