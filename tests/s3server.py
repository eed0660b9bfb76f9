"""A real S3-protocol server on 127.0.0.1 for the object-store tests: moto's server application
(PyPI ``moto[server]``) behind a WSGI layer that counts, on the server side, what clients ask for.

``S3Server.start()`` serves on a free port in a thread; ``url`` is the endpoint to give s3fs /
botocore (``AWS_ENDPOINT_URL_S3`` or ``client_kwargs={"endpoint_url": url}``). ``stats`` counts per
S3 operation the requests and the body bytes sent (GET) or received (PUT, UploadPart), and ``faults``
lets a test make the server fail requests (a 403, or a connection dropped mid-body) to check the
client's error paths. Credentials are dummies, passed through the environment as users would.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qs

# a request is (method, path, query dict, headers): return True to apply the fault
Match = Callable[[str, str, dict, dict], bool]


def operation(method: str, query: dict, headers: dict) -> str:
    """The S3 operation a request is, as far as the counters care."""
    if method == "GET":
        return "GetObject" if "range" not in headers else "GetObjectRange"
    if method == "HEAD":
        return "HeadObject"
    if method == "PUT":
        if "x-amz-copy-source" in headers:
            return "UploadPartCopy" if "partNumber" in query else "CopyObject"
        return "UploadPart" if "partNumber" in query else "PutObject"
    if method == "POST":
        return "CompleteMultipartUpload" if "uploadId" in query else "CreateMultipartUpload"
    if method == "DELETE":
        return "DeleteObject"
    return method


@dataclass
class Stats:
    requests: Counter = field(default_factory=Counter)
    bytes_out: Counter = field(default_factory=Counter)  # response bodies, per operation
    bytes_in: Counter = field(default_factory=Counter)  # request bodies, per operation
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.bytes_out.clear()
            self.bytes_in.clear()

    @property
    def downloaded(self) -> int:
        return self.bytes_out["GetObject"] + self.bytes_out["GetObjectRange"]

    @property
    def uploaded(self) -> int:
        return self.bytes_in["PutObject"] + self.bytes_in["UploadPart"]


@dataclass
class Fault:
    match: Match
    status: int | None = 403  # an HTTP error, or None: drop the connection after ``after`` body bytes
    after: int = 0
    times: int = 1 << 30  # how many requests it applies to


class _Counting:
    """WSGI middleware: counts requests and body bytes per operation, applies faults."""

    def __init__(self, app, stats: Stats, faults: list[Fault]) -> None:
        self.app, self.stats, self.faults = app, stats, faults

    def __call__(self, environ, start_response) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        path = environ.get("PATH_INFO", "")
        query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).items()}
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        op = operation(method, query, headers)
        if method == "GET" and "/" not in path.strip("/"):
            op = "ListObjects"  # a GET of the bucket itself is a listing, not an object's bytes
        n_in = int(environ.get("CONTENT_LENGTH") or 0)
        with self.stats.lock:
            self.stats.requests[op] += 1
            self.stats.bytes_in[op] += n_in
        for f in self.faults:
            if f.times > 0 and f.match(method, path, query, headers):
                f.times -= 1
                if f.status is not None:
                    body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                            b"<Message>Access Denied</Message></Error>")
                    start_response(f"{f.status} Forbidden", [("Content-Type", "application/xml"),
                                                            ("Content-Length", str(len(body)))])
                    return [body]
                return self._dropped(environ, start_response, f.after)
        return self._counted(self.app(environ, start_response), op)

    def _counted(self, body: Iterable[bytes], op: str) -> Iterable[bytes]:
        try:
            for chunk in body:
                with self.stats.lock:
                    self.stats.bytes_out[op] += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def _dropped(self, environ, start_response, after: int) -> Iterable[bytes]:
        body = self.app(environ, start_response)
        sent = 0
        for chunk in body:
            if sent + len(chunk) > after:
                yield chunk[: after - sent]
                raise ConnectionAbortedError("fault: connection dropped by the test server")
            sent += len(chunk)
            yield chunk


class S3Server:
    def __init__(self) -> None:
        self.stats = Stats()
        self.faults: list[Fault] = []
        self._server = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> S3Server:
        import logging

        from moto.moto_server.threaded_moto_server import MotoRequestHandler
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log in test output
        app = _Counting(DomainDispatcherApplication(create_backend_app), self.stats, self.faults)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-test-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def env(self) -> dict[str, str]:
        """What a user's environment would hold: the endpoint and (dummy) credentials, nothing on a command line."""
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")


if __name__ == "__main__":  # python tests/s3server.py: serve until interrupted (manual checks, benchmarks)
    import time

    s = S3Server().start()
    print(s.url, flush=True)
    os.environ.update(s.env())
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        s.stop()
