"""Running the app: the engine it serves, a bound socket, its URL, and uvicorn on a thread."""

from __future__ import annotations

import errno
import socket
import time
from typing import Optional


def make_engine(model, *, max_slots: int, kv_memory: Optional[int] = None, max_len: Optional[int] = None, **options):
    """The continuous-batching Engine (jaxinfer.serve.engine) for `model`: its pool sized from
    kv_memory bytes, or by default from a share of the free memory (see `Engine`)."""
    from jaxinfer.serve.engine import Engine

    return Engine(model, max_slots=max_slots, kv_memory=kv_memory, max_len=max_len, **options)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free port), not yet listening.

    Binding first makes a busy port or an address this machine does not have fail at once, before
    anything slow; uvicorn listens on the socket later (`uvicorn.Server.run(sockets=[sock])`).

    Args:
      host: an IP address or a name of this machine ("127.0.0.1", "::1", "0.0.0.0", "localhost").
      port: 0..65535.
    Returns:
      the bound socket. Raises ValueError naming host and port and what to do.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0 = a free port), got {port!r}")
    try:
        family, kind, proto_, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"host {host!r} is not an address or a name this machine can resolve ({e})") from None
    sock = socket.socket(family, kind, proto_)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port at once
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: "another program listens there: stop it or pick another port (0 = a free one)",
                errno.EADDRNOTAVAIL: "this machine has no such address: use 127.0.0.1 (this machine only) or "
                                     "0.0.0.0 (all interfaces)",
                errno.EACCES: "ports below 1024 need privileges: pick a port >= 1024"}.get(e.errno, "")
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}" + (f"; {hint}" if hint else "")) from None
    return sock


def url_of(sock: socket.socket) -> str:
    """http://host:port of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0):
    """Run `app` with uvicorn on a background thread (tests, load tests). port 0 = a free one.

    Returns (uvicorn.Server, thread, base url); `server.should_exit = True` stops it gracefully.
    """
    import threading

    import uvicorn

    sock = bind_socket(host, port)
    url = url_of(sock)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=sock.getsockname()[1], log_level="warning",
                                           timeout_graceful_shutdown=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="jaxinfer-serve", daemon=True)
    thread.start()
    t0 = time.perf_counter()
    while not server.started:
        if not thread.is_alive() or time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the server on {url} did not start")
        time.sleep(0.02)
    return server, thread, url
