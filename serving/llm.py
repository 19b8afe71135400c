"""Offline generation for scripts and notebooks: ``shiftjax.LLM(model).generate(prompts)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import NamedSharding

from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.load import load_checkpoint, load_tokenizer
from shiftjax.layouts.mesh import make_mesh
from shiftjax.layouts.specs import REPLICATED
from shiftjax.serving.engine import Engine, EngineConfig
from shiftjax.serving.sampling_params import SamplingParams
from shiftjax.weights import shard_params


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]
    modes: list[str]  # the mode of every step this request took part in

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class LLM:
    """A model loaded onto an ``sp x tp`` mesh with its steps compiled, ready to generate.

    ``model`` is a shiftjax checkpoint directory or ``"default"`` (SmolLM2-135M-Instruct,
    prepared on first use). Engine options (``max_model_len``, ``mode``, buckets...) are the
    fields of :class:`EngineConfig`.
    """

    def __init__(self, model: str = "default", *, sp: int = 1, tp: int = 1, dtype: str = "float32",
                 weight_storage: str = "aliased", devices=None, **engine_options):
        path = default_model_path() if model == "default" else model
        self.path = path
        self.mesh = make_mesh(sp, tp, devices)
        # Canonical weights land replicated on the mesh and are expanded there into blocks;
        # multi-process meshes need global arrays, which a restore with shardings gives.
        replicated = NamedSharding(self.mesh, REPLICATED)
        self.config, params = load_checkpoint(path, dtype=dtype, shardings=replicated)
        self.weights = shard_params(params, self.config, self.mesh, weight_storage)
        del params
        self.tokenizer = load_tokenizer(path)
        eos = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + self.config.eos_token_ids))
        self.engine = Engine(self.weights, EngineConfig(**engine_options), eos_token_ids=eos)

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
                 *, chat: bool = False) -> list[Completion]:
        """Generates for every prompt (text, or a list of token ids) in one batch."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.encode(p, chat=chat) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        requests = []
        try:
            for prompt_ids, sampling in zip(ids, params):
                requests.append(self.engine.add_request(prompt_ids, sampling))
        except Exception:  # one bad prompt fails the call and leaves nothing queued
            for request in requests:
                self.engine.scheduler.abort(request)
            raise
        self.engine.run_until_done(requests)
        return [
            Completion(prompt_ids=r.prompt_ids, output_ids=r.output_ids,
                       text=self.tokenizer.decode(r.output_ids), finish_reason=r.finish_reason,
                       logprobs=r.output_logprobs, modes=r.modes)
            for r in requests
        ]

