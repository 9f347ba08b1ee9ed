"""A real S3-compatible HTTP server on 127.0.0.1 for the tests (moto's server mode, a subprocess).

Clients talk HTTP to it through fsspec/s3fs, exactly as they would to S3; no
client is mocked. ``S3Server.storage_options`` is what nostall needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, NamedTuple, Optional

from tests.dist_harness import free_port


class S3Server:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the moto S3 server did not start")
                time.sleep(0.1)

    @property
    def storage_options(self) -> Dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"},
        }

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def make_bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class FlakyProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that can drop connections.

    ``outage(seconds)`` closes every live connection and resets every new one
    for that long, as a network blip or an overloaded endpoint would; then
    traffic flows again. ``dropped`` counts the connections it cut.
    """

    def __init__(self, upstream_port: int) -> None:
        import socket
        import threading

        self.upstream = ("127.0.0.1", upstream_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.dropped = 0
        self._until = 0.0
        self._live: list = []
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def storage_options(self) -> Dict[str, Any]:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"},
                "config_kwargs": {"retries": {"max_attempts": 1}}}  # leave retrying to nostall

    def outage(self, seconds: float) -> None:
        with self._lock:
            self._until = time.monotonic() + seconds
            for s in self._live:
                self._reset(s)
            self._live.clear()

    def _reset(self, s: Any) -> None:
        import socket
        import struct

        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass
        self.dropped += 1

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                if time.monotonic() < self._until:
                    self._reset(client)
                    continue
                try:
                    up = socket.create_connection(self.upstream)
                except OSError:
                    self._reset(client)
                    continue
                self._live.append(client)
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: Any, dst: Any) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()


class Served(NamedTuple):
    """One request :class:`CountingProxy` forwarded: ``nbytes``, the response body bytes sent back."""

    method: str
    key: str  # "bucket/key" (path-style), query left out
    status: int
    nbytes: int
    range: Optional[str]


class CountingProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 server that counts what the store serves.

    Every request is forwarded to the server as it came (method, path, headers,
    body) and its answer sent back; each one is logged in order as an
    :class:`Served` record: for a GET, the response body bytes the store served
    for that object key (ranged GETs included). A request to ``/__mark__/<name>``
    is not forwarded: it logs a mark, so a job's ranks can delimit a phase
    (:meth:`between`). Threaded; ``close()`` ends it and cuts its connections.
    """

    MARK = "/__mark__/"

    def __init__(self, upstream_port: int) -> None:
        import http.server
        import socketserver
        import threading

        self.upstream_port = upstream_port
        self.events: list = []  # Served records and marks, in the order they completed
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect
            timeout = 120  # an idle client connection is dropped after this (bounded threads)

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                proxy._forward(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _forward

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def __init__(self, *a: Any) -> None:
                self.live: set = set()
                super().__init__(*a)

            def process_request(self, request: Any, client_address: Any) -> None:
                with proxy._lock:
                    self.live.add(request)
                super().process_request(request, client_address)

            def shutdown_request(self, request: Any) -> None:
                with proxy._lock:
                    self.live.discard(request)
                super().shutdown_request(request)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True)
        self._thread.start()

    def storage_options(self) -> Dict[str, Any]:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"}}

    # ------------------------------------------------------------------ what was served
    def mark(self, name: str) -> None:
        """Log a mark here (ranks in other processes request ``url + MARK + name`` instead)."""
        with self._lock:
            self.events.append(("mark", name))

    def between(self, start: str, end: str) -> list:
        """The requests logged between the marks ``start`` and ``end`` (each logged once)."""
        with self._lock:
            events = list(self.events)
        names = [e[1] for e in events if not isinstance(e, Served)]
        for m in (start, end):
            if names.count(m) != 1:
                raise AssertionError(f"mark {m!r} logged {names.count(m)} times, not once (marks: {names})")
        i, j = events.index(("mark", start)), events.index(("mark", end))
        return [e for e in events[i + 1:j] if isinstance(e, Served)]

    @staticmethod
    def get_bytes(served: list) -> Dict[str, int]:
        """Response body bytes served for GETs, by object key ("bucket/key")."""
        out: Dict[str, int] = {}
        for s in served:
            if s.method == "GET":
                out[s.key] = out.get(s.key, 0) + s.nbytes
        return out

    # ------------------------------------------------------------------ forwarding
    _HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
            "trailer", "transfer-encoding", "upgrade"}

    @staticmethod
    def _body(h: Any) -> bytes:
        if "chunked" in h.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while h.rfile.readline().strip():  # trailers, then the blank line
                        pass
                    return bytes(out)
                out += h.rfile.read(size)
                h.rfile.readline()
        n = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(n) if n else b""

    def _forward(self, h: Any) -> None:
        import http.client
        import urllib.parse

        if h.path.startswith(self.MARK):
            self.mark(urllib.parse.unquote(h.path[len(self.MARK):]))
            h.send_response_only(200)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        body = self._body(h)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in self._HOP}
        if "chunked" in h.headers.get("Transfer-Encoding", "").lower():
            headers["Content-Length"] = str(len(body))
        up = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
        try:
            up.request(h.command, h.path, body=body if body or h.command in ("PUT", "POST") else None,
                       headers=headers)
            resp = up.getresponse()
            data = resp.read()
            status, reason, rheaders = resp.status, resp.reason, resp.getheaders()
        except (OSError, http.client.HTTPException) as e:
            data, status, reason, rheaders = str(e).encode(), 502, "Bad Gateway", []
        finally:
            up.close()
        key = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path).lstrip("/")
        h.send_response_only(status, reason)
        for k, v in rheaders:
            if k.lower() not in self._HOP and k.lower() != "content-length":
                h.send_header(k, v)
        if h.command == "HEAD":
            length = dict((k.lower(), v) for k, v in rheaders).get("content-length")
            if length is not None:
                h.send_header("Content-Length", length)
        elif status not in (204, 304) and not 100 <= status < 200:
            h.send_header("Content-Length", str(len(data)))
        sends = h.command != "HEAD" and status not in (204, 304)
        with self._lock:  # logged before the client has the answer: a phase's requests precede its end mark
            self.events.append(Served(h.command, key, status, len(data) if sends else 0, h.headers.get("Range")))
        h.end_headers()
        if sends:
            h.wfile.write(data)
            h.wfile.flush()

    def close(self) -> None:
        import socket

        self.server.shutdown()  # the accept loop (returns at once: serve_forever polls)
        self.server.server_close()
        with self._lock:
            live = list(self.server.live)
        for s in live:  # idle keep-alive connections: their handler threads end
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(10)
