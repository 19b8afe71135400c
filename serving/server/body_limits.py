"""What an HTTP client may send, and how slowly: the request body's size and read time,
the time to send headers, and how deep and what kind of JSON the body may hold.

- **Size.** A body past ``max_request_bytes`` is a 413, refused on its ``Content-Length``
  before a byte of it is read, or, sent chunked, as soon as the count passes the limit:
  no more than the limit is ever held. gRPC's receive limit is the same number
  (``grpc_server.GrpcServer``), so the two front ends take the same largest request.
- **Time.** Headers must arrive within ``read_timeout_seconds`` of the connection's first
  byte (uvicorn waits for ever: a client sending half a header line held its connection,
  and one of the server's, 70 s and more), and a body within ``read_timeout_seconds`` of
  its headers (408, connection closed). ``keep_alive_seconds`` is how long an idle
  connection is kept between requests, ``max_header_bytes`` the most h11 buffers of a
  request line and headers not yet complete (uvicorn answers 400 past it).
- **Shape.** JSON nested deeper than :data:`MAX_JSON_DEPTH` (Python's parser raised
  ``RecursionError`` at about 1,000 levels: a 500) and strings that are not Unicode text
  (a lone surrogate such as ``"\\ud800"``, which the tokenizer and the JSON encoder refuse
  later) are 400s naming where they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import h11
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.server.http_errors import ClientGone, Refused
from shiftjax.serving.server.validation import DEFAULT_MAX_REQUEST_BYTES, field_path

MAX_JSON_DEPTH = 32  # an OpenAI body nests 5 deep (messages.0.content.0.text); tool schemas a few more


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout_seconds: float = 30.0
    keep_alive_seconds: float = 5.0  # uvicorn's default, stated
    max_header_bytes: int = 16 * 1024  # h11's default, stated

    def __post_init__(self):
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if not self.read_timeout_seconds > 0 or not self.keep_alive_seconds > 0:
            raise ValueError("read_timeout_seconds and keep_alive_seconds must be positive")


def too_large(size: int | str, limit: int) -> Refused:
    return Refused(413, f"the request body has {size} bytes, more than this server's limit of {limit} "
                        f"(--max-request-bytes)", kind="invalid_request_error", param="body",
                   code="request_too_large")


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request's body, at most ``limits.max_request_bytes`` of it (else a 413), read
    within ``limits.read_timeout_seconds`` (else a 408 that closes the connection);
    :class:`ClientGone` if the client leaves first."""
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared, limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.read_timeout_seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(f"more than {limit}", limit)
                chunks.append(chunk)
    except TimeoutError:
        raise Refused(408, f"the request body did not arrive within {limits.read_timeout_seconds:g} s "
                           f"({size} bytes came)", kind="invalid_request_error", param="body",
                      code="request_timeout", close=True) from None
    except ClientDisconnect:
        raise ClientGone(f"{request.method} {request.url.path}: the client left after {size} bytes of its body") \
            from None
    return b"".join(chunks)


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH):
    """``body`` parsed as JSON, or :class:`InvalidRequest` naming ``body`` (not JSON, not
    UTF-8, nested past ``max_depth``) or the place of a string that is not Unicode text.
    CPU work: run it off the event loop."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise InvalidRequest("body", f"is nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as error:
        raise InvalidRequest("body", f"is not UTF-8: byte {error.start} cannot be decoded") from None
    except ValueError as error:  # json.JSONDecodeError, or an integer past Python's 4,300 digits
        raise InvalidRequest("body", f"is not valid JSON: {str(error)[:200]}") from None
    check_json_shape(value, max_depth)
    return value


def check_json_shape(value, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walks ``value`` without recursion: :class:`InvalidRequest` for nesting past
    ``max_depth`` (``body``) or a key or string holding a lone surrogate (its path)."""
    if isinstance(value, str) and not _is_text(value):
        raise InvalidRequest("body", "is a string holding a lone surrogate; send a JSON object")
    stack = [(value, (), 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, path, depth = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(key, str) and not _is_text(key) or isinstance(child, str) and not _is_text(child):
                raise InvalidRequest(field_path((*path, key)), "holds a lone surrogate (an escape such as \\ud800 that is half "
                                            "of a character): send Unicode text")
            if isinstance(child, (dict, list)):
                if depth >= max_depth:
                    raise InvalidRequest("body", f"is nested deeper than {max_depth} levels")
                stack.append((child, (*path, key), depth + 1))


def _is_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def timed_h11_protocol(read_timeout_seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request line and headers are not
    complete ``read_timeout_seconds`` after its first byte (or after it opened). The clock
    starts whenever no request is being served and bytes come in, and is not reset by more
    of them: a client trickling a byte a second is closed as surely as a silent one. The
    trailing body of a request refused early (413) is under the same clock."""

    class TimedH11Protocol(H11Protocol):
        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._serving():
                self._disarm()
            elif self._read_deadline is None:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _serving(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._read_deadline = self.loop.call_later(read_timeout_seconds, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            if self._serving() or self.transport.is_closing():
                return
            self.logger.debug("closing %s: no complete request within %g s", self.client, read_timeout_seconds)
            if self.conn.our_state not in (h11.ERROR, h11.CLOSED, h11.MUST_CLOSE):
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
            self.transport.close()

    return TimedH11Protocol
