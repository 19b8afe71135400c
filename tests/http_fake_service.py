"""A small deterministic EngineService for the HTTP front end's tests (no model, no JAX).

The tokenizer is character-level (token id = code point), so expected texts, token
counts and logprobs are known exactly. Every prompt is answered with :data:`REPLY` (or the
fake's ``reply``), one character per delta, ``token_delay`` seconds apart; the fake records
what was submitted, cancelled and closed so tests can check that a disconnect frees the
request. ``check_structured_outputs`` validates a constraint with llguidance, as the engine
compiles it, but needs no tokenizer (nothing is masked: the reply is whatever it is set to).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

from shiftjax.serving.engine.errors import InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.engine.stats import EngineSnapshot
from shiftjax.serving.server.protocol import (
    FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Delta, GenerationRequest, ServiceStats, TokenLogprob,
    Usage, prompt_ids_or_error,
)

REPLY = "Hello, wörld! ✓ Bye."
EOS = 3
VOCAB_SIZE = 0x3000


def logprob_of(position: int) -> float:
    return -0.125 * (position + 1)  # exact in binary, so JSON round trips compare equal


class CharTokenizer:
    """Token id = Unicode code point; EOS is id 3 (decoded only with special tokens)."""

    vocab_size = VOCAB_SIZE
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if (i == EOS and skip_special_tokens) else ("<eos>" if i == EOS else chr(i)) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        text = "".join(f"[tools]{json.dumps(tools)}\n" for _ in [tools] if tools)
        for m in messages:
            extra = {key: m[key] for key in ("tool_calls", "tool_call_id", "name") if key in m}
            text += f"[{m['role']}]{m['content']}" + (json.dumps(extra) if extra else "") + "\n"
        return text + ("[assistant]" if add_generation_prompt else "")


class FakeService:
    def __init__(self, *, token_delay: float = 0.0, max_model_len: int = 256):
        self.tokenizer = CharTokenizer()
        self.token_delay = token_delay
        self.max_model_len = max_model_len
        self.ready, self.draining = True, False
        self.error: str | None = None  # why the service stopped being ready, when set
        self.capacity: int | None = None  # live requests before Overloaded, when set
        self.echo = False  # reply with the prompt's text before REPLY, so replies differ by prompt
        self.reply = REPLY  # what every prompt is answered with
        self.checked: list = []  # the constraints check_structured_outputs was asked about
        self.fail_after: int | None = None  # tokens before an internal error, when set
        self.raise_after: int | None = None  # tokens before the stream raises RequestFailed
        # positions whose character is held back to the next delta (as the detokenizer holds
        # the bytes of an incomplete character): a delta with a token and no text
        self.hold_back: set[int] = set()
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.closed: list[str] = []
        self.live: set[str] = set()
        self._ids = itertools.count()

    def submit(self, request: GenerationRequest):
        if not self.ready or self.draining:
            raise Unavailable("the fake is not ready")
        if self.capacity is not None and len(self.live) >= self.capacity:
            raise Overloaded("the fake's queue is full")
        prompt_ids_or_error(request.prompt_ids, VOCAB_SIZE)
        if len(request.prompt_ids) + request.params.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", f"prompt plus max_tokens exceeds max_model_len {self.max_model_len}")
        request_id = request.request_id or f"fake-{next(self._ids)}"
        self.submitted.append(request)
        self.live.add(request_id)
        return self._stream(request_id, request, time.monotonic())

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        live = request_id in self.live
        self.live.discard(request_id)
        return live

    def check_structured_outputs(self, params):
        spec = params.structured_outputs
        if spec is None:
            return None
        import llguidance

        self.checked.append(spec)
        try:
            if spec.json is not None or spec.json_object:
                grammar = llguidance.grammar_from("json_schema", spec.json or '{"type": "object"}')
            elif spec.regex is not None:
                grammar = llguidance.grammar_from("regex", spec.regex)
            elif spec.choice is not None:
                grammar = llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in spec.choice))
            else:
                grammar = llguidance.grammar_from("grammar", spec.grammar)
            error = llguidance.LLMatcher.validate_grammar(grammar)
        except ValueError as exception:
            error = str(exception)
        if error:
            raise InvalidRequest(f"structured_outputs.{spec.kind}", f"does not compile: {error[:300]}")
        return ("compiled", spec)  # what the engine gets back in GenerationRequest.grammar

    def stats(self) -> ServiceStats:
        return ServiceStats(EngineSnapshot(running=len(self.live), num_pages=64, free_pages=64 - 2 * len(self.live)),
                            ready=self.ready, draining=self.draining, error=self.error)

    def info(self) -> dict:
        return {"model": "fake", "max_model_len": self.max_model_len}

    async def _stream(self, request_id: str, request: GenerationRequest, start: float):
        params = request.params
        produced = held = ""
        try:
            reply = (self.tokenizer.decode(request.prompt_ids) if self.echo else "") + self.reply + "\x03"
            for position, char in enumerate(reply):
                await asyncio.sleep(self.token_delay)
                if request_id not in self.live:  # cancelled
                    yield Delta(request_id, finish_reason=FINISH_ABORT, usage=self._usage(request, position, start))
                    return
                if self.raise_after is not None and position == self.raise_after:
                    raise RequestFailed("the fake failed")
                if self.fail_after is not None and position == self.fail_after:
                    yield Delta(request_id, finish_reason=FINISH_ERROR, usage=self._usage(request, position, start))
                    return
                token = ord(char)
                logprobs = ()
                if params.logprobs:
                    top = ((token, logprob_of(position)), (ord("x"), -8.0))[:params.top_logprobs]
                    logprobs = (TokenLogprob(token, logprob_of(position), top),)
                finish, stop_reason, text = None, None, char
                if token == EOS and not params.ignore_eos:
                    finish, stop_reason, text = FINISH_STOP, None, ""
                elif token in params.stop_token_ids:
                    finish, stop_reason, text = FINISH_STOP, token, ""
                else:
                    for stop in params.stop:
                        if stop in produced + char:
                            finish, stop_reason = FINISH_STOP, stop
                            text = (produced + char)[:(produced + char).index(stop)][len(produced):]
                            break
                if finish is None and position + 1 == params.max_tokens:
                    finish = FINISH_LENGTH
                if position in self.hold_back and finish is None:
                    held, text = held + text, ""
                else:
                    held, text = "", held + text
                produced += text
                usage = self._usage(request, position + 1, start) if finish else None
                yield Delta(request_id, token_ids=(token,), text=text, logprobs=logprobs, finish_reason=finish,
                            stop_reason=stop_reason, usage=usage)
                if finish:
                    return
        finally:
            self.live.discard(request_id)
            self.closed.append(request_id)

    def _usage(self, request, output_tokens, start) -> Usage:
        elapsed = time.monotonic() - start
        return Usage(prompt_tokens=len(request.prompt_ids), output_tokens=output_tokens, queue_seconds=0.0,
                     ttft_seconds=min(elapsed, 0.001), e2e_seconds=elapsed, modes=("tp",) * output_tokens)
