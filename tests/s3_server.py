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
from typing import Any, Dict

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
