"""The HTTP front end's errors: every refusal is the OpenAI error object,
``{"error": {"message", "type", "param", "code"}}``, with the status the service's error
class stands for, one table for all of them in :func:`error_for`.

InvalidRequest -> 400 (``param`` is the field), bad token -> 401, unknown model or path ->
404, a body read too slowly -> 408, a body past the limit -> 413, Overloaded -> 429,
RequestFailed -> 500, Unavailable -> 503. A 429 and a 503 say when to come back
(``Retry-After``), as load balancers and Kubernetes probes expect of a server that is busy,
starting or draining.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from shiftjax.serving.engine.errors import InvalidRequest, Overloaded, RequestFailed, Unavailable

log = logging.getLogger("shiftjax.serving.server.http_server")

RETRY_AFTER_OVERLOADED_SECONDS = 1  # a queue slot frees within a few steps
RETRY_AFTER_UNAVAILABLE_SECONDS = 5  # compiling, or draining towards a restart


class Refused(Exception):
    """An HTTP-level refusal that has no engine-service error class (401, 404, 408, 413).
    ``close`` asks the server to close the connection after the response (a client that
    cannot send a body in time gets no second chance on that connection)."""

    def __init__(self, status: int, message: str, *, kind: str, param: str | None = None, code: str | None = None,
                 close: bool = False):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.close = status, kind, param, code, close


class ClientGone(Exception):
    """The client closed the connection before its request was read: expected, logged at
    debug level in one line, and answered to nobody."""


def error_response(status: int, message: str, *, kind: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def unavailable_response(body: dict) -> JSONResponse:
    """A 503 with ``body`` and ``Retry-After`` (``/health`` while starting or draining)."""
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_SECONDS)})


def error_for(error: Exception) -> JSONResponse:
    """The OpenAI-shaped response for an error of the service contract (or any other)."""
    if isinstance(error, InvalidRequest):
        return error_response(400, str(error), kind="invalid_request_error", param=error.field)
    if isinstance(error, Refused):
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
        if error.close:
            headers["Connection"] = "close"
        return error_response(error.status, str(error), kind=error.kind, param=error.param, code=error.code,
                              headers=headers)
    if isinstance(error, Overloaded):
        return error_response(429, str(error) or "the server's admission queue is full; retry later",
                              kind="rate_limit_error", code="overloaded",
                              headers={"Retry-After": str(RETRY_AFTER_OVERLOADED_SECONDS)})
    if isinstance(error, Unavailable):
        return error_response(503, str(error) or "the server is starting or shutting down; retry later",
                              kind="service_unavailable_error", code="unavailable",
                              headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_SECONDS)})
    if isinstance(error, RequestFailed):
        return error_response(500, str(error) or "the request failed inside the engine", kind="server_error")
    log.exception("unexpected error in the HTTP front end", exc_info=error)
    return error_response(500, f"internal error: {type(error).__name__}", kind="server_error")
