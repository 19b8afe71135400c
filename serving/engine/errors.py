"""Errors a caller can act on; each front end maps them to its status codes in one place."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the service refuses as given; ``field`` names what to change."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Overloaded(Exception):
    """The bounded admission queue is full; answer RESOURCE_EXHAUSTED / HTTP 429."""


class Unavailable(Exception):
    """The service is starting or draining and takes no new requests (UNAVAILABLE / 503)."""


class RequestFailed(Exception):
    """An internal error failed this request (INTERNAL / 500); the service goes on."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before it finished; its pages are freed
    (DEADLINE_EXCEEDED). Only gRPC calls carry deadlines; the HTTP API sets none."""
