"""The ``openai`` bench backend: streamed ``/v1/completions`` over HTTP with ``httpx``.

Token-id prompts go in ``prompt`` as a list of ints (the OpenAI API allows it), with
``max_tokens`` the output length and vLLM's ``ignore_eos`` extension so that the output
has exactly that length. Every server-sent event whose first choice carries text counts
as one output chunk (TTFT, then ITL gaps); the token count is the ``usage`` the server
sends at the end of the stream (``stream_options.include_usage``), else the chunk count;
its ``prompt_tokens_details.cached_tokens`` are the prompt tokens the prefix cache had (0
when absent). A run's ``cache_salt`` (vLLM's field) goes with every request, and so does
shiftjax's ``disable_speculation`` when the run asks for it; the server's speculative
decoding counters are read from the same port's ``/metrics``. A multi-turn
chat needs each answer's token ids: it asks for them with vLLM's ``return_token_ids``
and reads each chunk's ``choices[0].token_ids``.
"""

from __future__ import annotations

import json
import time

import httpx

from shiftjax.serving.bench.metrics import RequestRecord, StreamClock
from shiftjax.serving.bench.speculation import SpeculationReading, reading_from_metrics


class OpenAIBackend:
    """One HTTP connection pool for the whole run; ``model`` defaults to the first model
    ``/v1/models`` lists."""

    name = "openai"

    def __init__(self, server: str, *, model: str | None = None, api_key: str | None = None,
                 endpoint: str = "/v1/completions", cache_salt: str | None = None, json_schema: str | None = None,
                 disable_speculation: bool = False):
        self.cache_salt = cache_salt
        self.json_schema = json_schema
        self.disable_speculation = disable_speculation
        self.base_url = server if server.startswith(("http://", "https://")) else f"http://{server}"
        self.model = model
        self.endpoint = endpoint
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "OpenAIBackend":
        # No pool limit and no read timeout: the run's concurrency is the load generator's
        # to set, and a request queued behind a long burst may wait minutes for its first token.
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=httpx.Timeout(None, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        if self.model is None:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.aclose()

    async def _first_model(self) -> str:
        try:
            response = await self._client.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise ConnectionError(
                f"cannot read the model name from {self.base_url}/v1/models ({error!r}); "
                "is the HTTP front end on (serve --http-port), or give --model"
            ) from None

    async def server_info(self) -> dict:
        response = await self._client.get("/v1/models")
        response.raise_for_status()
        return response.json()

    async def speculation(self) -> SpeculationReading | None:
        """The server's speculative decoding now, from ``/metrics`` (None when the port serves
        no metrics, or none of speculative decoding's)."""
        response = await self._client.get("/metrics")
        if response.status_code != 200:
            return None
        return reading_from_metrics(response.text)

    async def generate(self, record: RequestRecord, prompt_ids: list[int], clock=time.perf_counter, *,
                       keep_output_ids: bool = False) -> None:
        """Sends one request and fills ``record`` with what its stream showed (and the
        answer's token ids in ``record.output_ids`` with ``keep_output_ids``)."""
        payload = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": record.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cache_salt:
            payload["cache_salt"] = self.cache_salt
        if self.disable_speculation:
            payload["disable_speculation"] = True
        if self.json_schema is not None:
            payload["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "bench", "schema": json.loads(self.json_schema)}}
        if keep_output_ids:
            payload["return_token_ids"] = True
        timer = StreamClock(record, clock)
        server_tokens = None
        output_ids = []
        try:
            async with self._client.stream("POST", self.endpoint, json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {body[:500]}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and ": ping" comments
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # a failure after the status line went out
                        record.error = f"error event: {json.dumps(chunk['error'])[:500]}"
                        return
                    choices = chunk.get("choices") or ()
                    if choices and choices[0].get("text"):
                        timer.output_chunk()
                    if choices and keep_output_ids:
                        output_ids.extend(choices[0].get("token_ids") or ())
                    if usage := chunk.get("usage"):
                        server_tokens = usage.get("completion_tokens")
                        record.server_usage = usage
                        record.modes = list(usage.get("modes") or ())
                        record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            timer.finish(server_tokens)
            if keep_output_ids:
                record.output_ids = output_ids
                if record.success and not output_ids:
                    record.success = False
                    record.error = ("the stream carried no choices[].token_ids: the next turn needs the answer's "
                                    "token ids (vLLM's return_token_ids); --backend grpc always has them")
        except (httpx.HTTPError, ValueError, OSError) as error:
            record.success = False
            record.error = f"{type(error).__name__}: {error}"
