"""The OpenAI-compatible HTTP front end: a thin FastAPI adapter over an ``EngineService``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent
events with ``stream: true``), ``GET /v1/models``, ``GET /health`` (200 when ready, 503
while starting or draining) and, when given a :class:`~shiftjax.serving.server.metrics.Metrics`,
``GET /metrics``. With an ``api_key`` every ``/v1`` route needs
``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open for load balancers
and scrapers, as in vLLM.

Every error is the OpenAI error object, ``{"error": {"message", "type", "param", "code"}}``:
InvalidRequest -> 400 (``param`` is the field), bad token -> 401, unknown model -> 404,
Overloaded -> 429, RequestFailed -> 500, Unavailable -> 503. A client that disconnects
(streamed or not) cancels its requests at once, which frees their pages.

Embedding: ``uvicorn_server(create_app(...), host=..., port=...)`` gives a
``uvicorn.Server`` that leaves signal handling to its caller; ``await server.serve()`` runs
it in the caller's event loop (beside ``grpc.aio``), ``server.should_exit = True`` stops it.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from shiftjax.serving.server import openai_schema as schema
from shiftjax.serving.engine.errors import InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.server.metrics import Metrics
from shiftjax.serving.server.protocol import Delta, GenerationRequest, prompt_ids_or_error
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.server.http_streams import PromptStreams, Totals
from shiftjax.serving.server.validation import checked_cache_salt

log = logging.getLogger(__name__)

# Prompts in one /v1/completions request (each becomes its own engine request).
MAX_PROMPTS_PER_REQUEST = 256


class _Refused(Exception):
    """An HTTP-level refusal that has no engine-service error class (401, 404)."""

    def __init__(self, status: int, message: str, *, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def error_response(status: int, message: str, *, kind: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_for(error: Exception) -> JSONResponse:
    """The OpenAI-shaped response for an error of the service contract (or any other)."""
    if isinstance(error, InvalidRequest):
        return error_response(400, str(error), kind="invalid_request_error", param=error.field)
    if isinstance(error, _Refused):
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return error_response(error.status, str(error), kind=error.kind, param=error.param, code=error.code,
                              headers=headers)
    if isinstance(error, Overloaded):
        return error_response(429, str(error) or "the server's admission queue is full; retry later",
                              kind="rate_limit_error", code="overloaded")
    if isinstance(error, Unavailable):
        return error_response(503, str(error) or "the server is starting or shutting down; retry later",
                              kind="service_unavailable_error", code="unavailable")
    if isinstance(error, RequestFailed):
        return error_response(500, str(error) or "the request failed inside the engine", kind="server_error")
    log.exception("unexpected error in the HTTP front end", exc_info=error)
    return error_response(500, f"internal error: {type(error).__name__}", kind="server_error")


def create_app(service, *, model_name: str, api_key: str | None = None,
               metrics: Metrics | None = None):
    """The FastAPI application serving ``service`` (an ``EngineService``) under ``model_name``.

    ``metrics``, when given, is bound to ``service.stats`` and served at ``/metrics``.
    """
    app = FastAPI(title="shiftjax", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = service.tokenizer
    token_text = schema.TokenText(tokenizer)
    started = int(time.time())
    max_model_len_cache: list[int] = []
    if metrics is not None:
        metrics.bind_stats(service.stats)

    async def service_error(request, error: Exception):  # async: a sync handler would take a thread
        return error_for(error)

    for error_class in (InvalidRequest, _Refused, Overloaded, Unavailable, RequestFailed, Exception):
        app.add_exception_handler(error_class, service_error)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind=kind)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise _Refused(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           kind="authentication_error", code="invalid_api_key")

    async def parse_body(request: Request, model_class):
        authorize(request)
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest("body", "is not valid JSON") from None
        parsed = schema.parse(model_class, body)
        if parsed.model is not None and parsed.model != model_name:
            raise _Refused(404, f"the model {parsed.model!r} does not exist; this server serves {model_name!r}",
                           kind="not_found_error", param="model", code="model_not_found")
        schema.refuse_unimplemented(parsed)
        return parsed

    def max_model_len() -> int | None:
        if not max_model_len_cache:
            info = service.info()
            value = info.get("max_model_len") or (info.get("limits") or {}).get("max_model_len")
            if not isinstance(value, int):
                return None
            max_model_len_cache.append(value)
        return max_model_len_cache[0]

    def submit_all(prompts, params: list[SamplingParams], request_id: str, body) -> PromptStreams:
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        salt = checked_cache_salt(body.cache_salt)
        streams = PromptStreams(service, ids)
        try:
            for rid, prompt, sampling in zip(ids, prompts, params):
                streams.add(service.submit(GenerationRequest(prompt_ids=prompt, params=sampling, request_id=rid,
                                                             cache_salt=salt)), len(prompt))
        except InvalidRequest as error:
            streams.cancel_all()
            raise schema.rename_field(error, body) from None
        except BaseException:
            streams.cancel_all()  # a refused prompt refuses the whole request; the others are freed
            raise
        return streams

    @app.get("/health")
    async def health():
        try:
            stats = service.stats()
        except Exception as error:
            return JSONResponse({"status": "error", "message": repr(error)}, status_code=503)
        if stats.ready and not stats.draining:
            return JSONResponse({"status": "ok"})
        if stats.error is not None:
            return JSONResponse({"status": "error", "message": stats.error}, status_code=503)
        return JSONResponse({"status": "draining" if stats.draining else "starting"}, status_code=503)

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus():
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "shiftjax"}
        if (length := max_model_len()) is not None:
            card["max_model_len"] = length
        return card

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        authorize(request)
        if model_id != model_name:
            raise _Refused(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                           kind="not_found_error", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, schema.CompletionRequest)
        prompts = completion_prompts(body.prompt, tokenizer)
        top = body.logprobs or 0
        max_tokens = schema.COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        base = schema.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs is not None,
                                      top_logprobs=top)
        if body.max_tokens is None:  # the OpenAI default of 16, but never past the model's length
            params = [_fit_default(base, len(p), max_model_len()) for p in prompts]
        else:
            params = [base] * len(prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = submit_all(prompts, params, request_id, body)
        reply = _CompletionReply(request_id, model_name, token_text, len(prompts), body.logprobs is not None)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(streams, request, reply, include_usage)
        return JSONResponse(reply.body(await streams.collect(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, schema.ChatCompletionRequest)
        messages = schema.chat_messages(body)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as error:  # no template, or the template's raise_exception
            raise InvalidRequest("messages", f"cannot be rendered with the model's chat template: {error}") from None
        prompt = prompt_ids_or_error(tokenizer.encode(text, add_special_tokens=False), tokenizer.vocab_size,
                                     "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # the OpenAI default: as much as the context allows
            length = max_model_len()
            if length is not None and length <= len(prompt):
                raise InvalidRequest("messages", f"the prompt has {len(prompt)} tokens, which leaves no room "
                                                 f"to generate within max_model_len {length}")
            max_tokens = SamplingParams().max_tokens if length is None else length - len(prompt)
        params = schema.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs,
                                        top_logprobs=body.top_logprobs or 0)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = submit_all([prompt], [params], request_id, body)
        reply = _ChatReply(request_id, model_name, token_text, body.logprobs)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(streams, request, reply, include_usage)
        return JSONResponse(reply.body(await streams.collect(request)))

    return app


def completion_prompts(prompt, tokenizer) -> list[tuple[int, ...]]:
    """The token ids of each prompt of a /v1/completions request, as the OpenAI API reads
    ``prompt``: a string, a list of token ids, or a list of either (several prompts)."""
    vocab = tokenizer.vocab_size
    if isinstance(prompt, str):
        return [prompt_ids_or_error(tokenizer.encode(prompt, add_special_tokens=True), vocab, "prompt")]
    if not prompt:
        raise InvalidRequest("prompt", "is empty; give a string, a list of token ids, or a list of either")
    if isinstance(prompt[0], int):
        return [prompt_ids_or_error(prompt, vocab, "prompt")]
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise InvalidRequest("prompt", f"has {len(prompt)} prompts; send at most {MAX_PROMPTS_PER_REQUEST} "
                                       "per request")
    return [prompt_ids_or_error(tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p,
                                vocab, f"prompt.{i}") for i, p in enumerate(prompt)]


def _fit_default(params: SamplingParams, prompt_len: int, max_model_len: int | None) -> SamplingParams:
    if max_model_len is None or prompt_len + params.max_tokens <= max_model_len:
        return params
    return dataclasses.replace(params, max_tokens=max(1, max_model_len - prompt_len))


def _sse(streams: PromptStreams, request: Request, reply, include_usage: bool) -> StreamingResponse:
    """Server-sent events of ``reply``'s chunks; an error after the headers went out is an
    ``{"error": ...}`` event (the openai client raises it), then ``[DONE]``."""
    def event(chunk: dict) -> str:
        return f"data: {json.dumps(chunk, separators=(',', ':'), ensure_ascii=False)}\n\n"

    async def events():
        for chunk in reply.first_chunks(include_usage):
            yield event(chunk)
        try:
            async for index, delta in streams.deltas(request):
                if (chunk := reply.chunk(index, delta, include_usage)) is not None:
                    yield event(chunk)
        except Exception as error:  # the status line is sent; the error travels in the stream
            yield event(json.loads(error_for(error).body))
        else:
            if include_usage and not streams.client_gone:
                yield event(reply.usage_chunk(streams.totals))
        yield "data: [DONE]\n\n"

    # no-cache and no proxy buffering: each event must reach the client as it is made
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage(totals: list[Totals]) -> dict:
    prompt = sum(t.prompt_tokens for t in totals)
    output = sum(t.output_tokens for t in totals)
    cached = sum(t.usage.cached_prompt_tokens for t in totals if t.usage is not None)
    usage = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if len(totals) == 1 and totals[0].usage is not None:  # shiftjax's extension: how it was served
        u = totals[0].usage
        usage |= {"queue_seconds": u.queue_seconds, "ttft_seconds": u.ttft_seconds,
                  "e2e_seconds": u.e2e_seconds, "modes": list(u.modes), "preemptions": u.preemptions}
    return usage


class _CompletionReply:
    """/v1/completions bodies and chunks, built from the deltas of its prompts."""

    def __init__(self, request_id: str, model_name: str, token_text, num_prompts: int, logprobs: bool):
        self.head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name}
        self.token_text, self.logprobs = token_text, logprobs
        self.text_offset = [0] * num_prompts  # where each prompt's next token starts in its text

    def body(self, totals: list[Totals]) -> dict:
        choices = []
        for index, t in enumerate(totals):
            lp = schema.completion_logprobs(tuple(t.logprobs), self.token_text, 0) if self.logprobs else None
            choices.append({"index": index, "text": t.text, "logprobs": lp, "finish_reason": t.finish_reason,
                            "stop_reason": t.stop_reason})
        return self.head | {"choices": choices, "usage": _usage(totals)}

    def first_chunks(self, include_usage: bool) -> list[dict]:
        return []

    def chunk(self, index: int, delta: Delta, include_usage: bool) -> dict | None:
        # A chunk per step that produced tokens, even when their text is held back (the bytes
        # of an incomplete character): vLLM streams the same way, and a client timing tokens
        # by chunks (ITL) would otherwise see two tokens as one.
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return None
        lp = None
        if self.logprobs:
            lp = schema.completion_logprobs(delta.logprobs, self.token_text, self.text_offset[index])
            self.text_offset[index] += sum(len(token) for token in lp["tokens"])
        choice = {"index": index, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason}
        return self.head | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    def usage_chunk(self, totals: list[Totals]) -> dict:
        return self.head | {"choices": [], "usage": _usage(totals)}


class _ChatReply:
    """/v1/chat/completions bodies and chunks, built from the deltas of its one prompt."""

    def __init__(self, request_id: str, model_name: str, token_text, logprobs: bool):
        self.head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        self.chunk_head = self.head | {"object": "chat.completion.chunk"}
        self.token_text, self.logprobs = token_text, logprobs

    def body(self, totals: list[Totals]) -> dict:
        (t,) = totals
        lp = schema.chat_logprobs(tuple(t.logprobs), self.token_text) if self.logprobs else None
        choice = {"index": 0, "message": {"role": "assistant", "content": t.text}, "logprobs": lp,
                  "finish_reason": t.finish_reason, "stop_reason": t.stop_reason}
        return self.head | {"choices": [choice], "usage": _usage(totals)}

    def first_chunks(self, include_usage: bool) -> list[dict]:
        # OpenAI opens a chat stream with the role and empty content
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self.chunk_head | {"choices": [choice]} | ({"usage": None} if include_usage else {})]

    def chunk(self, index: int, delta: Delta, include_usage: bool) -> dict | None:
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return None  # as in _CompletionReply.chunk
        lp = schema.chat_logprobs(delta.logprobs, self.token_text) if self.logprobs else None
        content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        choice = {"index": 0, "delta": content, "logprobs": lp, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason}
        return self.chunk_head | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    def usage_chunk(self, totals: list[Totals]) -> dict:
        return self.chunk_head | {"choices": [], "usage": _usage(totals)}


def uvicorn_server(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
    """A ``uvicorn.Server`` for ``app`` that installs no signal handlers (its caller owns
    SIGTERM/SIGINT and stops it with ``server.should_exit = True``); ``await server.serve()``."""
    import uvicorn

    class _EmbeddedServer(uvicorn.Server):
        def capture_signals(self):
            import contextlib

            return contextlib.nullcontext()

    return _EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                          timeout_graceful_shutdown=5))
