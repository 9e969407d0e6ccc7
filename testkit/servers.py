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


class Ec2Capacity:
    """moto's EC2 with capacity: a proxy in front of moto's server that answers RunInstances of a
    sold-out (instance type, availability zone) with EC2's ``InsufficientInstanceCapacity`` (EC2
    API reference, "Error codes": "There is not enough capacity to fulfill your request", a
    server error, HTTP 500, with the EC2 XML error body) and forwards everything else unchanged.
    moto itself never runs out. ``url`` is the endpoint the provider account names."""

    def __init__(self, moto_url: str) -> None:
        import time
        import urllib.error
        import urllib.parse
        import urllib.request

        self.sold_out: set[tuple[str, str]] = set()
        self.refusals: list[tuple[str, str, float]] = []  # each refused RunInstances, and when
        self.launches: list[tuple[str, str, float]] = []  # each RunInstances forwarded, and when
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, headers: Any, body: bytes) -> None:
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "server",
                        "date",
                    ):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                form = urllib.parse.parse_qs(body.decode(errors="replace"))
                if form.get("Action") == ["RunInstances"]:
                    key = (form.get("InstanceType", [""])[0], form.get("Placement.AvailabilityZone", [""])[0])
                    if key in outer.sold_out:
                        outer.refusals.append((*key, time.time()))
                        xml = (
                            '<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error>'
                            "<Code>InsufficientInstanceCapacity</Code><Message>We currently do not have "
                            f"sufficient {key[0]} capacity in the Availability Zone you requested "
                            f"({key[1]}).</Message></Error></Errors><RequestID>capacity-1</RequestID></Response>"
                        ).encode()
                        self._answer(500, [("Content-Type", "text/xml")], xml)
                        return
                    outer.launches.append((*key, time.time()))
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                request = urllib.request.Request(
                    moto_url + self.path, data=body, headers=headers, method="POST"
                )
                try:
                    with urllib.request.urlopen(request, timeout=30) as answer:
                        self._answer(answer.status, answer.headers.items(), answer.read())
                except urllib.error.HTTPError as error:
                    self._answer(error.code, error.headers.items(), error.read())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sell_out(self, instance_type: str, zone: str, *, sold_out: bool = True) -> None:
        (self.sold_out.add if sold_out else self.sold_out.discard)((instance_type, zone))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
