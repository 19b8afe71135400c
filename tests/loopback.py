"""Helpers for tests that run real servers on loopback (not collected: no tests here)."""

import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, seconds: float = 5.0) -> bool:
    """Polls ``condition`` every 10 ms for up to ``seconds``; whether it became true."""
    give_up = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.01)
    return True
