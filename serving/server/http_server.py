"""The OpenAI-compatible HTTP front end: a thin FastAPI adapter over an ``EngineService``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent
events with ``stream: true``), ``GET /v1/models``, ``GET /health`` (200 when ready, 503
with ``Retry-After`` while starting or draining) and, when given a
:class:`~shiftjax.serving.server.metrics.Metrics`, ``GET /metrics``. With an ``api_key``
every ``/v1`` route needs ``Authorization: Bearer <key>`` (``validation.bearer_token_matches``,
the rule gRPC follows too); ``/health`` and ``/metrics`` stay open for load balancers and
scrapers, as in vLLM. Structured outputs and tool calls (``openai_structured.py``) become one
constraint on the engine's output, compiled on the pool before the request is submitted;
a chat reply under tools is read back into ``tool_calls`` (``tool_calls.py``).

Every error is the OpenAI error object (``http_errors.py`` has the table). A body is read
within the limits of ``body_limits.HttpLimits`` (size, time, depth), and parsed, tokenized
and rendered through its chat template on a ``TokenizePool``'s threads, never on the event
loop, which gRPC shares: a long prompt stalls no health check and no other stream. A client
that disconnects (streamed or not) cancels its requests at once, which frees their pages.

Embedding: ``uvicorn_server(create_app(...), host=..., port=...)`` gives a
``uvicorn.Server`` that leaves signal handling to its caller; ``await server.serve()`` runs
it in the caller's event loop (beside ``grpc.aio``), ``server.should_exit = True`` stops it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from shiftjax.serving.engine.errors import InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.server import openai_schema as schema
from shiftjax.serving.server import tool_calls
from shiftjax.serving.server.body_limits import HttpLimits, parse_json, read_body, timed_h11_protocol
from shiftjax.serving.server.http_errors import ClientGone, Refused, error_for, error_response, unavailable_response
from shiftjax.serving.server.http_replies import ChatReply, CompletionReply, sse
from shiftjax.serving.server.http_streams import PromptStreams
from shiftjax.serving.server.metrics import Metrics
from shiftjax.serving.server.openai_structured import OutputPlan, check_constraint, output_plan
from shiftjax.serving.server.protocol import GenerationRequest, prompt_ids_or_error
from shiftjax.serving.server.request_ids import new_request_id
from shiftjax.serving.server.tokenize_pool import TokenizePool, encode
from shiftjax.serving.server.validation import bearer_token_matches, checked_cache_salt, shown

log = logging.getLogger(__name__)

# Prompts in one /v1/completions request (each becomes its own engine request).
MAX_PROMPTS_PER_REQUEST = 256


def create_app(service, *, model_name: str, api_key: str | None = None, metrics: Metrics | None = None,
               limits: HttpLimits | None = None, pool: TokenizePool | None = None,
               tool_call_parser: str | None = None):
    """The FastAPI application serving ``service`` (an ``EngineService``) under ``model_name``.

    ``metrics``, when given, is bound to ``service.stats`` and served at ``/metrics``;
    ``limits`` bound what a client may send (default :class:`HttpLimits`); ``pool`` does the
    CPU work of each request (default: a :class:`TokenizePool` of this app's own);
    ``tool_call_parser`` (a name of ``tool_calls.PARSERS``, ``serve --tool-call-parser``)
    reads the tool calls of ``tool_choice: "auto"`` replies, which are refused without one.
    """
    if tool_call_parser is not None and tool_call_parser not in tool_calls.PARSERS:
        raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: {', '.join(tool_calls.PARSERS)}")
    app = FastAPI(title="shiftjax", docs_url=None, redoc_url=None, openapi_url=None)
    limits = limits or HttpLimits()
    pool = pool or TokenizePool()
    app.state.limits, app.state.pool = limits, pool
    tokenizer = service.tokenizer
    token_text = schema.TokenText(tokenizer)
    started = int(time.time())
    max_model_len_cache: list[int] = []
    if metrics is not None:
        metrics.bind_stats(service.stats)

    async def service_error(request, error: Exception):  # async: a sync handler would take a thread
        return error_for(error)

    for error_class in (InvalidRequest, Refused, Overloaded, Unavailable, RequestFailed, Exception):
        app.add_exception_handler(error_class, service_error)

    @app.exception_handler(ClientGone)
    async def client_gone(request, error: ClientGone):
        log.debug("%s", error)  # expected: one line, and nobody to answer
        return Response(status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind=kind)

    def authorize(request: Request) -> None:
        if api_key is not None and not bearer_token_matches(request.headers.get("authorization"), api_key):
            raise Refused(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                          kind="authentication_error", code="invalid_api_key")

    async def parse_body(request: Request, model_class):
        authorize(request)
        if service.stats().draining:  # refused before a byte of the body is read or tokenized
            raise Unavailable("the server is shutting down and takes no new requests")
        raw = await read_body(request, limits)
        return await pool.run(parsed_body, raw, model_class, model_name, tool_call_parser)

    def max_model_len() -> int | None:
        if not max_model_len_cache:
            info = service.info()
            value = info.get("max_model_len") or (info.get("limits") or {}).get("max_model_len")
            if not isinstance(value, int):
                return None
            max_model_len_cache.append(value)
        return max_model_len_cache[0]

    async def submit_all(prompts, params: list[SamplingParams], request_id: str, body,
                         plan: OutputPlan) -> PromptStreams:
        grammar = None
        if params[0].structured_outputs is not None:  # compiled off the loop, once for every prompt
            grammar = await pool.run(check_constraint, service, params[0], plan)
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        salt = checked_cache_salt(body.cache_salt)
        streams = PromptStreams(service, ids)
        try:
            for rid, prompt, sampling in zip(ids, prompts, params):
                streams.add(service.submit(GenerationRequest(prompt_ids=prompt, params=sampling, request_id=rid,
                                                             cache_salt=salt, grammar=grammar)), len(prompt))
        except InvalidRequest as error:
            streams.cancel_all()
            raise schema.rename_field(error, body, plan) from None
        except BaseException:
            streams.cancel_all()  # a refused prompt refuses the whole request; the others are freed
            raise
        return streams

    @app.get("/health")
    async def health():
        try:
            stats = service.stats()
        except Exception as error:
            return unavailable_response({"status": "error", "message": repr(error)})
        if stats.ready and not stats.draining:
            return JSONResponse({"status": "ok"})
        if stats.error is not None:
            return unavailable_response({"status": "error", "message": stats.error})
        return unavailable_response({"status": "draining" if stats.draining else "starting"})

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
            raise Refused(404, f"the model {shown(model_id)} does not exist; this server serves "
                               f"{model_name!r}", kind="not_found_error", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, plan = await parse_body(request, schema.CompletionRequest)
        prompts = await pool.run(completion_prompts, body.prompt, tokenizer)
        top = body.logprobs or 0
        max_tokens = schema.COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        base = schema.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs is not None,
                                      top_logprobs=top, plan=plan)
        if body.max_tokens is None:  # the OpenAI default of 16, but never past the model's length
            params = [_fit_default(base, len(p), max_model_len()) for p in prompts]
        else:
            params = [base] * len(prompts)
        request_id = new_request_id("cmpl")
        streams = await submit_all(prompts, params, request_id, body, plan)
        reply = CompletionReply(request_id, model_name, token_text, len(prompts), body.logprobs is not None)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return sse(streams, request, reply, include_usage)
        return JSONResponse(reply.body(await streams.collect(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, plan = await parse_body(request, schema.ChatCompletionRequest)
        prompt = await pool.run(chat_prompt, body, tokenizer, plan.template_tools())
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # the OpenAI default: as much as the context allows
            length = max_model_len()
            if length is not None and length <= len(prompt):
                raise InvalidRequest("messages", f"the prompt has {len(prompt)} tokens, which leaves no room "
                                                 f"to generate within max_model_len {length}")
            max_tokens = SamplingParams().max_tokens if length is None else length - len(prompt)
        params = schema.sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs,
                                        top_logprobs=body.top_logprobs or 0, plan=plan)
        request_id = new_request_id("chatcmpl")
        streams = await submit_all([prompt], [params], request_id, body, plan)
        reply = ChatReply(request_id, model_name, token_text, body.logprobs, plan.call_parser())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return sse(streams, request, reply, include_usage)
        return JSONResponse(reply.body(await streams.collect(request)))

    return app


def parsed_body(raw: bytes, model_class, model_name: str, tool_call_parser: str | None = None
                ) -> tuple[schema.CompletionRequest | schema.ChatCompletionRequest, OutputPlan]:
    """The body as ``model_class``, its model checked and its unimplemented values refused,
    and what it asks of its output (CPU work: on a pool thread)."""
    parsed = schema.parse(model_class, parse_json(raw))
    if parsed.model is not None and parsed.model != model_name:
        raise Refused(404, f"the model {shown(parsed.model)} does not exist; this server serves "
                           f"{model_name!r}", kind="not_found_error", param="model", code="model_not_found")
    schema.refuse_unimplemented(parsed)
    return parsed, output_plan(parsed, tool_call_parser)


def completion_prompts(prompt, tokenizer) -> list[tuple[int, ...]]:
    """The token ids of each prompt of a /v1/completions request, as the OpenAI API reads
    ``prompt``: a string, a list of token ids, or a list of either (several prompts)."""
    vocab = tokenizer.vocab_size
    if isinstance(prompt, str):
        return [prompt_ids_or_error(encode(tokenizer, prompt), vocab, "prompt")]
    if not prompt:
        raise InvalidRequest("prompt", "is empty; give a string, a list of token ids, or a list of either")
    if isinstance(prompt[0], int):
        return [prompt_ids_or_error(prompt, vocab, "prompt")]
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise InvalidRequest("prompt", f"has {len(prompt)} prompts; send at most {MAX_PROMPTS_PER_REQUEST} "
                                       "per request")
    return [prompt_ids_or_error(encode(tokenizer, p) if isinstance(p, str) else p, vocab, f"prompt.{i}")
            for i, p in enumerate(prompt)]


def chat_prompt(body: schema.ChatCompletionRequest, tokenizer, tools: list[dict] | None = None) -> tuple[int, ...]:
    """The token ids of a chat request's messages, rendered with the model's chat template
    (given ``tools``, as Hugging Face templates take them, when there are any)."""
    messages = schema.chat_messages(body)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             **({"tools": tools} if tools else {}))
    except Exception as error:  # no template, or the template's raise_exception
        raise InvalidRequest("messages", f"cannot be rendered with the model's chat template: "
                                         f"{str(error)[:300]}") from None
    return prompt_ids_or_error(encode(tokenizer, text, add_special_tokens=False), tokenizer.vocab_size, "messages")


def _fit_default(params: SamplingParams, prompt_len: int, max_model_len: int | None) -> SamplingParams:
    if max_model_len is None or prompt_len + params.max_tokens <= max_model_len:
        return params
    return dataclasses.replace(params, max_tokens=max(1, max_model_len - prompt_len))


def uvicorn_server(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                   tls_files: tuple[Path, Path] | None = None, limits: HttpLimits | None = None):
    """A ``uvicorn.Server`` for ``app`` that installs no signal handlers (its caller owns
    SIGTERM/SIGINT and stops it with ``server.should_exit = True``); ``await server.serve()``.
    ``tls_files`` (certificate chain, private key: PEM files) serves HTTPS; ``limits``
    (default: the app's, else :class:`HttpLimits`) sets the header and keep-alive timeouts."""
    import contextlib

    import uvicorn

    limits = limits or getattr(getattr(app, "state", None), "limits", None) or HttpLimits()

    class _EmbeddedServer(uvicorn.Server):
        def capture_signals(self):
            return contextlib.nullcontext()

    cert, key = tls_files if tls_files is not None else (None, None)
    return _EmbeddedServer(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
        http=timed_h11_protocol(limits.read_timeout_seconds), timeout_keep_alive=limits.keep_alive_seconds,
        h11_max_incomplete_event_size=limits.max_header_bytes, ssl_certfile=cert, ssl_keyfile=key))
