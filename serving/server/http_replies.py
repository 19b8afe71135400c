"""The OpenAI API's response bodies and server-sent events, built from the deltas of a
request's prompts (``http_streams.PromptStreams``): ``/v1/completions`` and
``/v1/chat/completions``, whole or streamed, with usage and logprobs, and a chat reply's
tool calls (read by a ``tool_calls.CallParser``)."""

from __future__ import annotations

import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from shiftjax.serving.server import openai_schema as schema
from shiftjax.serving.server.http_errors import error_for
from shiftjax.serving.server.http_streams import PromptStreams, Totals
from shiftjax.serving.server.protocol import FINISH_STOP, Delta
from shiftjax.serving.server.tool_calls import CallParser, Step, parse_whole


def sse(streams: PromptStreams, request: Request, reply, include_usage: bool) -> StreamingResponse:
    """Server-sent events of ``reply``'s chunks; an error after the headers went out is an
    ``{"error": ...}`` event (the openai client raises it), then ``[DONE]``. A stream the
    server ends (draining, past its grace) ends as any other: its last chunk carries
    ``finish_reason: "abort"``, then ``[DONE]``."""
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


def usage_of(totals: list[Totals]) -> dict:
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


class CompletionReply:
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
        return self.head | {"choices": choices, "usage": usage_of(totals)}

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
        return self.head | {"choices": [], "usage": usage_of(totals)}


class ChatReply:
    """/v1/chat/completions bodies and chunks, built from the deltas of its one prompt;
    with ``calls`` (a request with tools), the reply's tool calls are read out of its text."""

    def __init__(self, request_id: str, model_name: str, token_text, logprobs: bool, calls: CallParser | None = None):
        self.head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        self.chunk_head = self.head | {"object": "chat.completion.chunk"}
        self.token_text, self.logprobs = token_text, logprobs
        self.calls = calls

    def body(self, totals: list[Totals]) -> dict:
        (t,) = totals
        lp = schema.chat_logprobs(tuple(t.logprobs), self.token_text) if self.logprobs else None
        message = {"role": "assistant", "content": t.text}
        if self.calls is not None:
            content, calls = parse_whole(self.calls, t.text)
            message["content"] = content or (None if calls or self.calls.forced else "")
            if calls:
                message["tool_calls"] = [call.to_json() for call in calls]
        choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": self._finish(t.finish_reason),
                  "stop_reason": t.stop_reason}
        return self.head | {"choices": [choice], "usage": usage_of(totals)}

    def first_chunks(self, include_usage: bool) -> list[dict]:
        # OpenAI opens a chat stream with the role and empty content (null when the reply
        # can only be tool calls)
        content = None if self.calls is not None and self.calls.forced else ""
        choice = {"index": 0, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                  "finish_reason": None}
        return [self.chunk_head | {"choices": [choice]} | ({"usage": None} if include_usage else {})]

    def chunk(self, index: int, delta: Delta, include_usage: bool) -> dict | None:
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return None  # as in CompletionReply.chunk
        lp = schema.chat_logprobs(delta.logprobs, self.token_text) if self.logprobs else None
        if self.calls is None:
            content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        else:
            step = self.calls.feed(delta.text) if delta.text else Step()
            if delta.finish_reason is not None:
                step.merge(self.calls.finish())
            content = ({"content": step.content} if step.content else {}) | \
                ({"tool_calls": [call.to_json() for call in step.calls]} if step.calls else {})
        choice = {"index": 0, "delta": content, "logprobs": lp, "finish_reason": self._finish(delta.finish_reason),
                  "stop_reason": delta.stop_reason}
        return self.chunk_head | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    def usage_chunk(self, totals: list[Totals]) -> dict:
        return self.chunk_head | {"choices": [], "usage": usage_of(totals)}

    def _finish(self, reason: str | None) -> str | None:
        """``"tool_calls"`` for a reply that ended of itself (not cut by max_tokens) with calls."""
        if reason == FINISH_STOP and self.calls is not None and self.calls.count:
            return "tool_calls"
        return reason
