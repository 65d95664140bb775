"""Servers on 127.0.0.1 for tests: a range-capable HTTP file server that can inject faults, and a
fault-injecting HTTP proxy (put in front of e.g. moto's S3 server)."""
from __future__ import annotations

import contextlib
import http.client
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class Faults:
    """What the server does wrong, shared with the handler threads. Counters count down per request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.errors_5xx = 0      # answer the next N data requests with 503
        self.resets = 0          # close the connection mid-body on the next N requests
        self.truncations = 0     # send a short body (with the full Content-Length) on the next N requests
        self.stall_s = 0.0       # sleep this long before answering (every request)
        self.hangs = 0           # the next N data requests hang hang_s before sending anything
        self.body_hangs = 0      # the next N data requests send half the body, then hang hang_s
        self.hang_s = 30.0
        self.stall_after: int | None = None  # every data request sends this many body bytes, then hangs hang_s
        self.released = threading.Event()    # set when the server stops: hangs end then
        self.corruptions = 0     # the next N data requests get a body with one byte flipped (right length)
        self.access_key = None   # proxy: answer 403 (S3's InvalidAccessKeyId) unless the request is signed with it
        self.requests = 0
        self.paths: list[str] = []  # path of every request, in order
        self.ranges: list[str | None] = []  # the Range header of every request, in order

    def hang(self) -> None:
        """Wait ``hang_s`` seconds, or until the server stops."""
        self.released.wait(self.hang_s)

    def take(self, name: str) -> bool:
        with self.lock:
            n = getattr(self, name)
            if n > 0:
                setattr(self, name, n - 1)
                return True
            return False


def _handler(root: str, faults: Faults):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _target(self):
            path = os.path.normpath(os.path.join(root, self.path.split("?", 1)[0].lstrip("/")))
            return path if path.startswith(root) and os.path.isfile(path) else None

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _serve(self, body: bool):
            with faults.lock:
                faults.requests += 1
                faults.paths.append(f"{self.command} {self.path}")
                faults.ranges.append(self.headers.get("Range"))
            if faults.stall_s:
                time.sleep(faults.stall_s)
            if body and faults.take("hangs"):
                faults.hang()
                self.close_connection = True
                return
            path = self._target()
            if path is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            size = os.path.getsize(path)
            start, end = 0, size - 1
            rng = self.headers.get("Range")
            if body and faults.take("errors_5xx"):
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if rng and rng.startswith("bytes="):
                lo, _, hi = rng[6:].partition("-")
                start = int(lo) if lo else 0
                end = min(int(hi), size - 1) if hi else size - 1
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            else:
                self.send_response(200)
            length = max(0, end - start + 1)
            self.send_header("Content-Length", str(length))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if not body:
                return
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length)
            if data and faults.take("corruptions"):
                data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
            if faults.take("resets"):
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if faults.take("truncations"):
                self.wfile.write(data[: len(data) // 3])
                self.wfile.flush()
                self.close_connection = True
                return
            if faults.take("body_hangs"):
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                faults.hang()
                self.close_connection = True
                return
            if faults.stall_after is not None and len(data) > faults.stall_after:
                self.wfile.write(data[: faults.stall_after])
                self.wfile.flush()
                faults.hang()
                self.close_connection = True
                return
            self.wfile.write(data)

    return Handler


@contextlib.contextmanager
def _serving(handler):
    """Run ``handler`` on 127.0.0.1 (a free port) in a thread; yields the base URL; stops it after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def http_server(root: str):
    """Serve ``root`` on 127.0.0.1 (a free port); yields ``(base_url, faults)``."""
    faults = Faults()
    try:
        with _serving(_handler(os.path.realpath(root), faults)) as base:
            yield base, faults
    finally:
        faults.released.set()


def _proxy_handler(upstream: str, faults: Faults, is_data):
    target = urlsplit(upstream)

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _s3_error(self, status: int, code: str, message: str):
            payload = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                       f"<Message>{message}</Message></Error>").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _forward(self):
            with faults.lock:
                faults.requests += 1
                faults.paths.append(f"{self.command} {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if faults.access_key and f"Credential={faults.access_key}/" not in (self.headers.get("Authorization") or ""):
                self._s3_error(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist.")
                return
            data_request = self.command == "GET" and is_data(self.path)
            if data_request and faults.take("hangs"):
                faults.hang()
                self.close_connection = True
                return
            if data_request and faults.take("errors_5xx"):
                self._s3_error(503, "ServiceUnavailable", "injected")
                return
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
                self.send_response(resp.status, resp.reason)
                skip = ("connection", "keep-alive", "transfer-encoding", "server", "date")
                if self.command != "HEAD":  # a HEAD answer keeps the upstream length of the body it does not send
                    skip += ("content-length",)
                for k, v in resp.getheaders():
                    if k.lower() not in skip:
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
            finally:
                conn.close()
            if self.command == "HEAD":
                return
            if data_request and payload and faults.take("resets"):
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if data_request and payload and faults.take("truncations"):
                self.wfile.write(payload[: len(payload) // 3])
                self.wfile.flush()
                self.close_connection = True
                return
            if data_request and payload and faults.take("body_hangs"):
                self.wfile.write(payload[: len(payload) // 2])
                self.wfile.flush()
                faults.hang()
                self.close_connection = True
                return
            self.wfile.write(payload)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    return Proxy


@contextlib.contextmanager
def plain_http_server(root: str, *, cuts: int = 0):
    """``python -m http.server``'s own handler on 127.0.0.1 (no Range support), serving ``root``;
    the first ``cuts`` bodies break off halfway. Yields ``(base_url, requests)``: each request's
    ``(path, Range header)``."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler

    requests: list[tuple[str, str | None]] = []
    left = [cuts]

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_head(self):
            requests.append((self.path, self.headers.get("Range")))
            return super().send_head()

        def copyfile(self, source, outputfile):
            if self.command == "GET" and left[0] > 0:
                left[0] -= 1
                data = source.read()
                outputfile.write(data[: len(data) // 2])
                outputfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            super().copyfile(source, outputfile)

    with _serving(partial(Handler, directory=root)) as base:
        yield base, requests


@contextlib.contextmanager
def fault_proxy(upstream: str, *, is_data=lambda path: True):
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``) that injects ``Faults``
    into GET requests for which ``is_data(path)`` holds; yields ``(base_url, faults)``."""
    faults = Faults()
    try:
        with _serving(_proxy_handler(upstream, faults, is_data)) as base:
            yield base, faults
    finally:
        faults.released.set()


@contextlib.contextmanager
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port); yields its ``http://127.0.0.1:port`` endpoint."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
