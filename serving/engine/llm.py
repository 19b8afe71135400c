"""Offline generation for scripts and notebooks: ``shiftjax.LLM(model).generate(prompts)``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.load import load_tokenizer, load_weights, tokenizer_path_for
from shiftjax.layouts.mesh import make_mesh
from shiftjax.serving.engine.core import Engine, EngineConfig, StepReport
from shiftjax.serving.engine.grammar import GrammarCompiler
from shiftjax.serving.engine.output_processor import OutputProcessor
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.request import Request
from shiftjax.serving.engine.speculative import SpeculativeConfig
from shiftjax.params import Params, param_shapes, params_from_flat, params_to_flat
from shiftjax.quantization import describe as describe_quantization
from shiftjax.weights import ModelWeights, canonical_params, shard_params


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]
    modes: list[str]  # the mode of every step this request took part in
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class LLM:
    """A model loaded onto an ``sp x tp`` mesh with its steps compiled, ready to generate.

    ``model`` is a shiftjax checkpoint directory or ``"default"`` (SmolLM2-135M-Instruct,
    prepared on first use); with ``load_format="dummy"``, a Hugging Face ``config.json``
    whose shape gets random weights (``tokenizer``: a directory with ``tokenizer.json``,
    default the default model's). Engine options (``max_model_len``, ``mode``, buckets,
    ``num_pages``, ``enable_prefix_caching``, ``speculative``: a :class:`SpeculativeConfig` or
    the dict of its fields...) are the fields of :class:`EngineConfig`;
    ``report(message)`` receives start-up progress (page pool, compiles). ``quantization``:
    ``"fp8"`` serves the layer GEMM weights in FP8 (quantized as they load), ``"none"`` in
    ``dtype``, None as the checkpoint says; ``cache_dtype="fp8"`` (or ``"float8_e4m3fn"``)
    keeps the KV cache in FP8.
    """

    def __init__(self, model: str = "default", *, sp: int = 1, tp: int = 1, dtype: str = "float32",
                 weight_storage: str = "aliased", devices=None, load_format: str = "orbax",
                 tokenizer: str | None = None, quantization: str | None = None, report=None, **engine_options):
        self.path = default_model_path() if model == "default" else Path(model)
        self.mesh = make_mesh(sp, tp, devices)
        started = time.perf_counter()
        # Each device restores only the blocks it holds (checkpoints.load.restore_weights).
        self.config, self.weights = load_weights(model, mesh=self.mesh, dtype=dtype, weight_storage=weight_storage,
                                                 load_format=load_format, quantization=quantization)
        jax.block_until_ready((self.weights.tp, self.weights.sp))  # time the loading, not its dispatch
        self.load_seconds = time.perf_counter() - started
        if report is not None:
            report(f"weights ready in {self.load_seconds:.1f} s ({load_format})")
            report(f"quantization {describe_quantization(self.weights.quantization, self.weights.tp.embed.dtype)}")
        self.tokenizer = load_tokenizer(tokenizer_path_for(model, load_format, tokenizer))
        eos = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + self.config.eos_token_ids))
        grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.config.vocab_size, eos)
        if isinstance(engine_options.get("speculative"), dict):  # as vLLM's speculative_config
            engine_options["speculative"] = SpeculativeConfig(**engine_options["speculative"])
        self.engine = Engine(self.weights, EngineConfig(**engine_options), eos_token_ids=eos, report=report,
                             grammar_compiler=grammars)
        self._host_weights: Params | None = None  # the weights while asleep at level 2

    @property
    def compile_seconds(self) -> float:
        return self.engine.compile_seconds

    # --- weights in and out, and device memory between rollouts (a training loop's needs) ---

    def get_weights(self) -> Params:
        """The served weights as canonical parameters (the checkpoint's layout, ``x @ w``,
        layers stacked), made on the devices from the stored blocks."""
        if self._host_weights is not None:
            return self._host_weights
        return canonical_params(self.weights)

    def update_weights(self, params: Params | dict[str, jax.Array | np.ndarray]) -> None:
        """Serves ``params`` from the next request, without compiling: a whole ``Params`` (as
        :meth:`get_weights` gives, e.g. after a training step), or a dict of some of its leaves
        by path (``{"layers.wq": ..., "lm_head": ...}``, the others kept). Each leaf must have
        the served shape and dtype (a mismatch is refused naming the leaf). The blocks are
        re-laid on the devices (the old ones are freed after, so both are held for a moment);
        the prefix cache is dropped. Refused while requests run or while asleep."""
        if self.engine.asleep:
            raise RuntimeError("update_weights needs an awake engine: call wake_up() first")
        self.engine.refuse_while_busy("update_weights")  # before the blocks are made
        flat = dict(params) if isinstance(params, dict) else params_to_flat(params)
        shapes = param_shapes(self.config)
        unknown = sorted(set(flat) - set(shapes))
        if unknown:
            raise ValueError(f"{unknown[0]}: not a parameter of this model (its leaves: {', '.join(shapes)})")
        dtype = jnp.dtype(self.weights.tp.final_norm.dtype)
        for path, array in flat.items():
            if tuple(array.shape) != shapes[path] or jnp.dtype(array.dtype) != dtype:
                raise ValueError(f"{path}: got {tuple(array.shape)} {jnp.dtype(array.dtype).name}, "
                                 f"the model has {shapes[path]} {dtype.name}")
        devices = set(self.mesh.devices.flat)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        # arrays committed to other devices (a checkpoint restored on one, a trainer's mesh)
        # come over whole; those on this mesh's devices are re-laid where they are
        flat = {path: jax.device_put(array, replicated)
                if isinstance(array, jax.Array) and array.sharding.device_set != devices else array
                for path, array in flat.items()}
        if len(flat) < len(shapes):
            if self.weights.quantization != "none":
                raise ValueError("FP8 weights are updated whole: give every leaf")
            flat = params_to_flat(canonical_params(self.weights)) | flat
        new = shard_params(params_from_flat(flat), self.config, self.mesh, self.weights.storage,
                           self.weights.quantization)
        old = self.weights
        self.engine.replace_weights(new)
        self.weights = new
        _delete_weights(old)

    def sleep(self, level: int = 1) -> int:
        """Frees device memory between rollouts; returns the bytes freed over all devices.
        Level 1 frees the KV cache (and the prefix cache); level 2 also the weights, kept on
        the host until :meth:`wake_up`.
        Compiled steps are kept either way. Refused while requests run."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if level == 2 and self.weights.quantization != "none":
            raise ValueError("sleep(2) keeps canonical weights on the host, which FP8 weights do not have")
        freed = self.engine.free_caches()
        if level == 2 and self._host_weights is None:
            self._host_weights = jax.device_get(canonical_params(self.weights))
            freed += _delete_weights(self.weights)
        return freed

    def wake_up(self) -> None:
        """Undoes :meth:`sleep`: the weights back on the devices (level 2) and a fresh KV cache."""
        if self._host_weights is not None:
            self.weights = shard_params(self._host_weights, self.config, self.mesh, self.weights.storage)
            self.engine.replace_weights(self.weights)
            self._host_weights = None
        self.engine.restore_caches()

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, chat: bool = False, cache_salt: str | Sequence[str | None] | None = None) -> list[Completion]:
        """Generates for every prompt (text, or a list of token ids) in one batch.

        ``cache_salt`` (one for every prompt, or one per prompt): a prompt shares cached
        prefix pages only with prompts of the same salt (None: the shared cache); each
        completion's ``cached_tokens`` says how many of its prompt tokens were found cached."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        salts = [cache_salt] * len(prompts) if cache_salt is None or isinstance(cache_salt, str) else list(cache_salt)
        if len(salts) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(salts)} cache salts")
        if any(salt is not None and not isinstance(salt, str) for salt in salts):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        ids = [self.encode(p, chat=chat) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        requests = []
        try:
            for prompt_ids, sampling, salt in zip(ids, params, salts):
                requests.append(self.engine.add_request(prompt_ids, sampling, salt))
        except Exception:  # one bad prompt fails the call and leaves nothing queued
            for request in requests:
                self.engine.abort(request)
            raise
        outputs = self._run(requests)
        return [
            # (to what the output processor took: a stop string can end it inside a step's tokens)
            Completion(prompt_ids=r.prompt_ids, output_ids=r.output_ids[:outputs[r][1].sent], text=outputs[r][0],
                       finish_reason=outputs[r][1].finish_reason, logprobs=r.output_logprobs[:outputs[r][1].sent],
                       modes=r.modes,
                       stop_reason=outputs[r][1].stop_reason, cached_tokens=r.num_cached_tokens)
            for r in requests
        ]

    def _run(self, requests: list[Request]) -> dict[Request, tuple[str, OutputProcessor]]:
        """Steps until every request is done; stop strings end a request (and free its
        pages) in the step whose text completes them. Returns each one's text and its
        output processor (which holds the finish and stop reasons)."""
        outputs = {r: OutputProcessor(self.tokenizer, r.params, stream=False) for r in requests}
        pieces: dict[Request, list[str]] = {r: [] for r in requests}

        def deltas(report: StepReport) -> None:
            for request, sampled in zip(report.requests, report.sampled):
                if not sampled or request not in outputs:
                    continue
                delta = outputs[request].update(request)
                pieces[request].append(delta.text)
                if delta.finish_reason is not None and not request.finished:  # a stop string
                    self.engine.abort(request, delta.finish_reason)

        self.engine.run_until_done(requests, on_step=deltas)
        return {r: ("".join(pieces[r]), outputs[r]) for r in requests}


def _delete_weights(weights: ModelWeights) -> int:
    """Frees ``weights``' device buffers; returns their bytes over all devices (the two views
    share the aliased blocks' buffers: each is counted once)."""
    freed, seen = 0, set()
    for leaf in jax.tree.leaves((weights.tp, weights.sp)):
        for shard in leaf.addressable_shards:
            buffer = shard.data
            pointer = buffer.unsafe_buffer_pointer()
            if pointer not in seen:
                seen.add(pointer)
                freed += buffer.nbytes
    for leaf in jax.tree.leaves((weights.tp, weights.sp)):
        if not leaf.is_deleted():
            leaf.delete()
    return freed
