"""Request ids: the server's, which no client can guess, and the rule for a client's own.

A server id carries 96 random bits (``secrets``), so no client can take the id of a request
it did not make (the ids were ``req-0``, ``req-1``, ...: a client that opened streams as
``req-3`` and ``req-4`` made the next ordinary requests fail as "already in flight"). A
client's id is a label it reads back: at most :data:`MAX_REQUEST_ID_LENGTH` printable ASCII
characters, so that it can be echoed and logged without carrying megabytes or terminal
escapes.
"""

from __future__ import annotations

import secrets

from shiftjax.serving.engine.errors import InvalidRequest

MAX_REQUEST_ID_LENGTH = 128


def new_request_id(prefix: str = "req") -> str:
    """``prefix-`` and 24 random hex digits."""
    return f"{prefix}-{secrets.token_hex(12)}"


def checked_request_id(request_id, field: str = "request_id") -> str | None:
    """``request_id`` (None or "" when the client gave none: None), or
    :class:`InvalidRequest` naming ``field``: a string of 1 to :data:`MAX_REQUEST_ID_LENGTH`
    printable ASCII characters (space to ``~``), no control characters."""
    if request_id is None or request_id == "":
        return None
    if not isinstance(request_id, str):
        raise InvalidRequest(field, f"must be a string, got {type(request_id).__name__}")
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequest(field, f"has {len(request_id)} characters; give at most {MAX_REQUEST_ID_LENGTH}")
    bad = next((i for i, c in enumerate(request_id) if not " " <= c <= "~"), None)
    if bad is not None:
        raise InvalidRequest(field, f"has {request_id[bad]!r} at position {bad}; use printable ASCII characters "
                                    "(space to '~') only")
    return request_id
