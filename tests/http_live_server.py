"""A real uvicorn server on loopback, in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

from shiftjax.serving.server.http_server import uvicorn_server


@contextlib.contextmanager
def live_server(app, **options):
    """Serves ``app`` on 127.0.0.1 at a free port; yields the base URL. ``options`` go to
    ``uvicorn_server`` (``tls_files``: the URL is https; ``limits``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn_server(app, host="127.0.0.1", port=port, **options)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the uvicorn server did not start within 30 s")
        time.sleep(0.01)
    try:
        yield f"{'https' if options.get('tls_files') else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
