"""Weights in and out of a running ``LLM``, and its device memory between rollouts.

``get_weights`` inverts the block layout on every mesh (padded heads, duplicated KV heads,
padded vocabulary); ``update_weights`` serves new weights with the steps already compiled,
exactly as a fresh ``LLM`` loaded from a checkpoint of them, whole or a few leaves at a time,
and refuses a leaf that does not fit by name; ``sleep`` frees the KV cache (level 1) and the
weights (level 2) and ``wake_up`` gives back the same outputs. A tiny random Llama checkpoint
(float32, untied head, 4 heads over 2 KV heads) is the model.
"""

import json

import jax
import numpy as np
import pytest
from hf_tiny import make_tiny_hf_checkpoint

from shiftjax.checkpoints import convert_hf_checkpoint, load_checkpoint
from shiftjax.checkpoints.dummy import write_checkpoint
from shiftjax.checkpoints.load import restore_weights
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import params_to_flat
from shiftjax.weights import canonical_params

ENGINE = dict(max_model_len=48, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(4,),
              attention="reference", mode="alternate")
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    hf_dir, _ = make_tiny_hf_checkpoint(root / "hf", "llama", num_heads=4, num_kv_heads=2, vocab_size=100, seed=5,
                                        with_tokenizer=True)
    return convert_hf_checkpoint(hf_dir, root / "ckpt", dtype="float32")


def greedy(llm, max_tokens=6):
    from shiftjax import SamplingParams

    return [c.output_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


@pytest.fixture(scope="module")
def llm(checkpoint):
    import shiftjax

    return shiftjax.LLM(str(checkpoint), sp=2, tp=2, dtype="float32", enable_prefix_caching=True, **ENGINE)


@pytest.mark.parametrize("sp,tp", [(1, 1), (2, 2), (4, 2), (1, 8)])
def test_the_canonical_weights_come_back_bit_for_bit_on_every_mesh(checkpoint, sp, tp):
    _, params = load_checkpoint(checkpoint)
    _, weights = restore_weights(checkpoint, mesh=make_mesh(sp, tp), dtype="float32")
    got, want = params_to_flat(canonical_params(weights)), params_to_flat(params)
    assert got.keys() == want.keys()
    for path, array in want.items():
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(array), err_msg=path)


def test_updated_weights_decode_as_a_fresh_llm_of_them_with_nothing_compiled(llm, checkpoint, tmp_path):
    import shiftjax

    before = greedy(llm)
    compiled = dict(llm.engine.executables.compiled)
    seconds = dict(llm.engine.executables.compile_seconds)
    rng = np.random.default_rng(0)
    new = jax.tree.map(lambda w: w + 0.05 * rng.standard_normal(w.shape).astype(np.float32),
                       jax.device_get(llm.get_weights()))
    llm.update_weights(new)
    after = greedy(llm)
    assert after != before  # the new weights are served
    assert llm.engine.executables.compiled == compiled and llm.engine.executables.compile_seconds == seconds
    hf_config = json.loads((checkpoint / "config.json").read_text())
    written = write_checkpoint(jax.tree.map(jax.numpy.asarray, new), hf_config, tmp_path / "new")
    fresh = shiftjax.LLM(str(written), sp=2, tp=2, dtype="float32", tokenizer=str(checkpoint),
                         **ENGINE)
    assert greedy(fresh) == after
    # and back: the first weights give the first tokens again
    _, first = load_checkpoint(checkpoint)
    llm.update_weights(first)
    assert greedy(llm) == before


def test_swapping_two_lm_head_columns_swaps_the_first_greedy_token(llm):
    first = greedy(llm, max_tokens=1)[0][0]
    other = (first + 1) % llm.config.vocab_size
    lm_head = np.array(llm.get_weights().lm_head)
    lm_head[:, [first, other]] = lm_head[:, [other, first]]
    llm.update_weights({"lm_head": lm_head})  # one leaf; the others stay
    assert greedy(llm, max_tokens=1)[0][0] == other
    lm_head[:, [first, other]] = lm_head[:, [other, first]]
    llm.update_weights({"lm_head": lm_head})
    assert greedy(llm, max_tokens=1)[0][0] == first


@pytest.mark.parametrize("leaf, named", [
    ({"layers.wq": np.zeros((2, 64, 32), np.float32)}, "layers.wq: got (2, 64, 32) float32"),
    ({"embed": np.zeros((100, 64), np.float16)}, "embed: got (100, 64) float16"),
    ({"layers.q_norm": np.zeros((2, 16), np.float32)}, "layers.q_norm: not a parameter of this model"),
])
def test_a_leaf_that_does_not_fit_is_refused_by_name(llm, leaf, named):
    before = greedy(llm, max_tokens=2)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        llm.update_weights(leaf)
    assert greedy(llm, max_tokens=2) == before  # nothing changed


def test_sleep_frees_the_kv_cache_then_the_weights_and_wake_up_changes_no_token(llm):
    before = greedy(llm)
    kv_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(llm.engine.caches))
    assert llm.sleep(1) == kv_bytes and llm.engine.asleep
    with pytest.raises(RuntimeError, match="asleep"):
        greedy(llm)
    llm.wake_up()
    assert greedy(llm) == before
    freed = llm.sleep(2)
    assert freed > kv_bytes and all(leaf.is_deleted() for leaf in jax.tree.leaves(llm.weights.tp))
    np.testing.assert_array_equal(llm.get_weights().embed, load_checkpoint_embed(llm))  # kept on the host
    llm.wake_up()
    assert not llm.engine.asleep and greedy(llm) == before


def load_checkpoint_embed(llm):
    return load_checkpoint(llm.path)[1].embed
