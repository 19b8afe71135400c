"""The checkpoint's tokenizer: a ``tokenizers.Tokenizer`` plus its special tokens and chat template.

Chat templates are rendered the way ``transformers`` renders them (a sandboxed, immutable
jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, a
``tojson`` that does not escape HTML, ``strftime_now``, and ``bos_token``/``eos_token``
... in scope), so a checkpoint's template gives the same prompt text here as there.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from shiftjax.checkpoints.format import CheckpointError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model."""

    def __init__(
        self,
        backend,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ):
        self.backend = backend  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = {name: None for name in _SPECIAL_NAMES} | dict(special_tokens or {})
        eos_ids = []
        eos = self.special_tokens["eos_token"]
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.append(backend.token_to_id(eos))
        eos_ids += [i for i in extra_eos_token_ids if i not in eos_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self._compiled_template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Reads ``tokenizer.json``, ``tokenizer_config.json`` and, if present, the eos ids of
        ``generation_config.json`` from a checkpoint or Hugging Face directory."""
        import tokenizers

        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{path} has no tokenizer.json; convert from a Hugging Face directory that has one, "
                "or pass token ids instead of text"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{tokenizer_file} cannot be read: {error}") from None
        config = _read_json(path / "tokenizer_config.json")
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default") or next(iter(named.values()), None)
        if not chat_template and (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text()
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        special_map = _read_json(path / "special_tokens_map.json")
        for name in _SPECIAL_NAMES:
            if special[name] is None:
                special[name] = _token_text(special_map.get(name))
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        return cls(
            backend,
            chat_template=chat_template or None,
            special_tokens=special,
            extra_eos_token_ids=tuple(generation_eos or ()),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens["bos_token"]
        return None if bos is None else self.backend.token_to_id(bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor
        (e.g. Llama 3's BOS). A rendered chat prompt already has its special tokens, so encode it
        with ``add_special_tokens=False``."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_vars
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``)."""
        if not self.chat_template:
            raise CheckpointError(
                "this tokenizer has no chat template (tokenizer_config.json has no chat_template); "
                "send plain prompts instead"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile(self.chat_template)
        variables = {name: value for name, value in self.special_tokens.items() if value is not None}
        variables.update(template_vars)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    return value if isinstance(value, dict) else {}


def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise CheckpointError(f"the chat template does not parse: {error}") from None
