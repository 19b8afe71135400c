"""Structured outputs compiled to token masks, with llguidance.

llguidance (Microsoft's grammar engine, the one vLLM offers beside xgrammar) was chosen
because it needs no PyTorch (xgrammar's Python package depends on it), compiles a grammar
lazily in about a millisecond (JSON schemas, regexes, Lark and GBNF grammars alike), and
fills a step's masks for many rows in parallel, in Rust, with the GIL released.

A :class:`GrammarCompiler` turns a :class:`StructuredOutputs` into a :class:`CompiledGrammar`
once per distinct constraint (a bounded LRU cache; front ends compile in their worker
threads, so the engine thread finds it cached); each request gets its own
:class:`GrammarState`, a copy of the compiled matcher that consumes the request's tokens as
they are committed. :func:`fill_masks` writes a step's allowed tokens as a bitmask, one bit
per token id, 32 ids per int32 word (bit ``i % 32`` of word ``i // 32``), the layout
``shiftjax.sampling.allowed_tokens`` reads on the devices.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time

import numpy as np

from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.structured_outputs import StructuredOutputs

DEFAULT_MAX_CACHED = 256  # distinct constraints kept compiled


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    """A validated constraint: ``matcher`` is its start state, copied for each request."""

    spec: StructuredOutputs
    matcher: object  # llguidance.LLMatcher, never advanced itself
    seconds: float  # how long compiling took


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, compiled: CompiledGrammar):
        self.matcher = compiled.matcher.deep_copy()

    def accept(self, token: int) -> bool:
        """Consumes a sampled token; False if the grammar forbids it (the mask was not applied)."""
        return bool(self.matcher.consume_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows no further token (only the end of sequence)."""
        return bool(self.matcher.is_stopped())

    @property
    def failed(self) -> bool:
        """The matcher hit an error (a limit of llguidance's): it then allows only the end of
        sequence, which must not read as a complete output."""
        return bool(self.matcher.is_error())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (``tokenizer_json``: its ``tokenizer.json``
    text) whose ids the model's ``vocab_size`` covers; ``eos_token_ids`` end a constrained
    output once its grammar is complete. Thread-safe: front ends compile on their worker
    threads while the engine thread looks compiled grammars up."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_cached: int = DEFAULT_MAX_CACHED):
        if max_cached < 1:
            raise ValueError(f"max_cached must be at least 1, got {max_cached}")
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_cached = max_cached
        self._cache: collections.OrderedDict[StructuredOutputs, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._llg_tokenizer = None
        self.compiles = 0
        self.cache_hits = 0
        self.compile_seconds = 0.0

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | None = None,
                      **options) -> "GrammarCompiler":
        """From a shiftjax ``Tokenizer`` (its ``tokenizers`` backend); ``eos_token_ids``: the
        engine's (default: the tokenizer's), which a complete output may end with, less any
        the tokenizer does not have (a model config's, beside another model's tokenizer:
        llguidance refuses them, and the grammar never allows an id outside the tokenizer)."""
        eos = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
        known = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        return cls(tokenizer.backend.to_str(), vocab_size, tuple(i for i in eos if i < known), **options)

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled ``spec``, from the cache or compiled now; :class:`InvalidRequest`
        naming ``structured_outputs.<kind>`` for one that does not compile."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return compiled
        compiled = self._compile(spec)  # outside the lock: others' lookups need not wait
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            self.compiles += 1
            self.compile_seconds += compiled.seconds
        return compiled

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        import llguidance

        started = time.perf_counter()
        field = f"structured_outputs.{spec.kind}"
        grammar = _grammar_or_refusal(llguidance, spec)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(field, f"does not compile: {_first_lines(matcher.get_error())}")
        return CompiledGrammar(spec, matcher, time.perf_counter() - started)

    def _tokenizer(self):
        with self._lock:  # made once, on the first compile (~0.2 s for a 49k vocabulary)
            if self._llg_tokenizer is None:
                import llguidance

                self._llg_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids) or None)
            return self._llg_tokenizer


def check_grammar(spec: StructuredOutputs) -> None:
    """Refuses ``spec`` if it does not compile, as :meth:`GrammarCompiler.compile` would, without
    a tokenizer: a command line checks its constraint before it loads and compiles a model."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(_grammar_or_refusal(llguidance, spec))
    if error:
        raise InvalidRequest(f"structured_outputs.{spec.kind}", f"does not compile: {_first_lines(error)}")


def _grammar_or_refusal(llguidance, spec: StructuredOutputs) -> str:
    try:
        return _grammar_text(llguidance, spec)
    except ValueError as error:
        raise InvalidRequest(f"structured_outputs.{spec.kind}", str(error)) from None


def _grammar_text(llguidance, spec: StructuredOutputs) -> str:
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # a Lark alternation of JSON-quoted literals
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


def _first_lines(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class MaskFiller:
    """Fills the rows of a step's bitmask in parallel (llguidance's executor)."""

    def __init__(self):
        import llguidance

        self._executor = llguidance.LLExecutor()

    def fill(self, bitmask: np.ndarray, rows: list[tuple[GrammarState, int]]) -> None:
        """Writes each ``(state, row)``'s allowed tokens into ``bitmask[row]``; the other rows
        are left as they are (all ones: every token allowed)."""
        if rows:
            import llguidance.numpy

            llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(s.matcher, r) for s, r in rows], bitmask)


def allow_all(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask that allows every token of every row."""
    return np.full((rows, mask_words(vocab_size)), -1, np.int32)
