"""Small servers on loopback that stand in for the far side of a test or benchmark: a JSON
HTTP endpoint (a webhook well's external system) and moto (S3 and EC2)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from testkit.processes import free_port

# (status, answer) or (status, answer, headers)
Respond = Callable[[str, dict[str, Any]], tuple[Any, ...]]


class JsonServer:
    """Answers each POST with ``respond(path, body)`` -> (status, answer[, headers]), JSON both ways, in
    a thread of its own; ``url`` is its base URL."""

    def __init__(self, respond: Respond) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                code, answer, *extra = respond(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(code)
                for name, value in (extra[0] if extra else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's server on a free port (every AWS service it mocks); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def moto_client(service: str, url: str, region: str = "us-east-1") -> Any:
    """A boto3 client of ``service`` against the moto server at ``url``."""
    import boto3

    return boto3.client(
        service, endpoint_url=url, region_name=region, aws_access_key_id="test", aws_secret_access_key="test"
    )
