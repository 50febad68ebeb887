"""HTTP(S) on loopback: the listening socket, TLS, keep-alive connections, the request handler.

The handler reads a request and hands it to a ``handle`` function, which answers a
:class:`Response` and how long to hold it; the server keeps its open connections so that
:meth:`HTTPServer.cut_connections` can end them as a killed process would.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import ssl
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

JSON_CONTENT = "application/json"
MAX_BODY = 3 * 1024 * 1024
"""apiserver's ``--max-request-body-bytes`` default: a larger body is a 413."""


@dataclass
class Response:
    """An answer: status code, body, its content type and extra headers (one value per line)."""

    code: int
    body: bytes
    content_type: str = JSON_CONTENT
    headers: dict[str, str] = field(default_factory=dict)


Handle = Callable[[str, str, Any, bytes, bool], tuple[Response, float]]
"""``handle(method, path with query, headers, body, oversized)`` -> (answer, seconds to hold it)."""


class HTTPServer(http.server.ThreadingHTTPServer):
    """Serves ``handle`` on ``address`` (HTTPS with ``tls``: certificate and key files), and
    tracks its connections so that :meth:`cut_connections` can cut keep-alive ones too.
    ``stopping`` set: held answers are dropped."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handle: Handle, stopping: threading.Event,
                 tls: tuple[str, str] | None) -> None:
        self.answer = handle
        self.stopping = stopping
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            # the handshake in the connection's own thread (``finish_request``), not in accept
            self.socket = ctx.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except (OSError, ssl.SSLError):
                return  # a client that refused our certificate: nothing to answer
        super().finish_request(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def cut_connections(self) -> None:
        """Close every open connection: their clients see a reset, as from a killed process."""
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HTTPServer

    def version_string(self) -> str:
        """The ``Server`` header (kube-apiserver sends none; a name helps when reading captures)."""
        return "kube-apiserver-stand-in"

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr lines (the records are in ``StandInAPIServer.requests``)."""

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.rfile.read(length)
            body = b""
            oversized = True
        else:
            body = self.rfile.read(length) if length else b""
            oversized = False
        resp, delay = self.server.answer(self.command, self.path, self.headers, body, oversized)
        if delay and self.server.stopping.wait(delay):
            self.close_connection = True
            return
        try:
            self.send_response(resp.code)
            self.send_header("Content-Type", resp.content_type)
            self.send_header("Content-Length", str(len(resp.body)))
            self.send_header("Cache-Control", "no-cache, private")
            self.send_header("Audit-Id", str(uuid.uuid4()))
            for k, v in resp.headers.items():
                for line in v.split("\n"):
                    self.send_header(k, line)
            self.end_headers()
            self.wfile.write(resp.body)
        except OSError:
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _serve
