"""Offline generation for scripts and notebooks: ``shiftjax.LLM(model).generate(prompts)``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.load import load_tokenizer, load_weights, tokenizer_path_for
from shiftjax.layouts.mesh import make_mesh
from shiftjax.serving.engine.core import Engine, EngineConfig, StepReport
from shiftjax.serving.engine.grammar import GrammarCompiler
from shiftjax.serving.engine.output_processor import OutputProcessor
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.request import Request
from shiftjax.serving.engine.speculative import SpeculativeConfig
from shiftjax.quantization import describe as describe_quantization


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

    @property
    def compile_seconds(self) -> float:
        return self.engine.compile_seconds

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
