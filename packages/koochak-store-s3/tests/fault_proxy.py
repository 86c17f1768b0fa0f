"""A loopback HTTP proxy in front of a real S3 server that injects faults by request kind.

Each request is classified (``put``, ``create``, ``part``, ``complete``, ``abort``, ``get``,
``head``, ``list``, ``delete``) and a plan may answer its n-th request of a kind with:

* ``"503"``: a SlowDown error, without forwarding (the server never sees it);
* ``"drop"``: read half of the request body, then close the connection (a connection lost
  mid-part; the server never sees the request);
* ``"lose"``: forward the request, then close the connection without answering (the server
  did it; the client never hears);
* ``"cut"``: forward, answer with the headers and half of the body, then close;
* ``"short"``: forward, answer with half of the body and a Content-Length to match (the
  Content-Range still names the whole window: a server that sends less than it says);
* ``"short_whole"``: both: Range ignored, and half of the whole object sent;
* ``"ignore_range"``: forward without the ``Range`` header (the server answers 200 with the
  whole object, as a server or proxy that ignores Range does);
* ``"shift_range"``: forward with the requested window moved one byte on (a 206 for another
  window than the one asked for).

It listens on 127.0.0.1 only and stops with the test.
"""

from __future__ import annotations

import http.client
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def kind_of(method: str, target: str) -> str:
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    if method == "PUT":
        return "part" if "partNumber" in query else "put"
    if method == "POST":
        return "complete" if "uploadId" in query else "create"
    if method == "DELETE":
        return "abort" if "uploadId" in query else "delete"
    if method == "HEAD":
        return "head"
    path = parts.path.strip("/")
    return "list" if "/" not in path else "get"


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.plan: dict[tuple[str, int], str] = {}  # (kind, n-th) -> fault
        self.always: dict[str, str] = {}  # kind -> fault for every request of that kind
        self.seen: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []  # (kind, what happened)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _decide(self, kind: str) -> str:
        with self._lock:
            self.seen[kind] += 1
            fault = self.plan.get((kind, self.seen[kind])) or self.always.get(kind, "pass")
            self.log.append((kind, fault))
            return fault

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        kind = kind_of(h.command, h.path)
        fault = self._decide(kind)
        length = int(h.headers.get("Content-Length") or 0)
        if fault == "drop":
            h.rfile.read(length // 2)
            h.close_connection = True
            h.connection.shutdown(2)
            return
        body = h.rfile.read(length) if length else b""
        if fault == "503":
            h.send_response(503)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(_SLOW_DOWN)))
            h.end_headers()
            h.wfile.write(_SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            headers = _rewrite_range(headers, fault)
            upstream.request(h.command, h.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        if fault == "lose":
            h.close_connection = True
            h.connection.shutdown(2)
            return
        if fault in ("short", "short_whole"):
            data = data[: len(data) // 2]
        h.send_response(answer.status, answer.reason)
        for name, value in answer.getheaders():
            if name.lower() not in _HOP and name.lower() != "content-length":
                h.send_header(name, value)
        length_header = answer.getheader("Content-Length") if h.command == "HEAD" else None
        h.send_header("Content-Length", length_header or str(len(data)))
        h.end_headers()
        if h.command == "HEAD":
            return
        if fault == "cut":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(data)


def _rewrite_range(headers: dict[str, str], fault: str) -> dict[str, str]:
    if fault not in ("ignore_range", "short_whole", "shift_range"):
        return headers
    name = next((k for k in headers if k.lower() == "range"), None)
    if name is None:
        return headers
    if fault in ("ignore_range", "short_whole"):
        return {k: v for k, v in headers.items() if k != name}
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", headers[name])
    assert match, headers[name]
    last = f"{int(match.group(2)) + 1}" if match.group(2) else ""
    return {**headers, name: f"bytes={int(match.group(1)) + 1}-{last}"}
