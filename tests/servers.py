"""Servers on 127.0.0.1 for tests: a range-capable HTTP file server that can inject faults."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Faults:
    """What the server does wrong, shared with the handler threads. Counters count down per request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.errors_5xx = 0      # answer the next N data requests with 503
        self.resets = 0          # close the connection mid-body on the next N requests
        self.truncations = 0     # send a short body (with the full Content-Length) on the next N requests
        self.stall_s = 0.0       # sleep this long before answering (every request)
        self.requests = 0

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
            if faults.stall_s:
                time.sleep(faults.stall_s)
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
            self.wfile.write(data)

    return Handler


@contextlib.contextmanager
def http_server(root: str):
    """Serve ``root`` on 127.0.0.1 (a free port); yields ``(base_url, faults)``."""
    faults = Faults()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(os.path.realpath(root), faults))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
