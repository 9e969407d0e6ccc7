"""What the fake GitHub (testkit/github_fake.py) and the fake GitLab (testkit/gitlab_fake.py)
share: the HTTP server and its threads, the answer written back, the call log, ``fail_next``, the
webhook sender (its reordering window and the POST), and the controls under ``/_fake/``. Each
fake says what differs: its routes, its deliveries' headers, its jobs' JSON. Standard library
only."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Self
from urllib.parse import parse_qs, urlsplit

RUNNER_FAULTS = ("crash", "hang", "never_connect", "deprecated")


def clock() -> float:
    """The fakes' clock: ``time.time`` looked up at each call, so a simulation that replaces it
    (testkit.ci_sim.SimClock) moves every timestamp a fake makes, its records' defaults too."""
    return time.time()


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class FakeForge:
    """The shared machinery. A subclass sets ``name``, the float faults ``/_fake/faults`` takes,
    and implements ``_route``, ``_delivery_headers``, ``_queue_from``, ``_job_json``,
    ``cancel_job`` and ``summary``; its ``reset`` sets the state (``outbox`` holds
    ``(delivery, duplicate)`` pairs; a delivery has ``body``, ``status_code``, ``duration``,
    ``delivered_at``)."""

    name: ClassVar[str]
    fault_rates: ClassVar[tuple[str, ...]] = (
        "error_rate",
        "latency",
        "lost_rate",
        "duplicate_rate",
        "reorder_rate",
    )
    not_found: ClassVar[str] = "Not Found"

    jobs: dict[int, Any]
    calls: list[tuple[str, str, int]]
    outbox: deque[tuple[Any, bool]]
    held_back: list[tuple[Any, float]]
    runner_faults: deque[str]
    reorder_rate: float
    error_rate: float
    _fail_next: list[tuple[re.Pattern[str], int, int]]

    def __init__(self, *, webhook_url: str, seed: int, port: int) -> None:
        self.webhook_url = webhook_url
        self.port = port
        self.rng = random.Random(seed)
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def reset(self) -> None:
        raise NotImplementedError

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, *, background: bool = True) -> Self:
        """Serve the API in a thread; ``background``: also send the deliveries and sweep in
        threads of their own (a simulation sends them itself, :meth:`send_outbox`, and sweeps,
        :meth:`sweep`, at each of its steps, on its own thread and clock)."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                fake._handle(self)

            do_POST = do_DELETE = do_PUT = do_PATCH = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._stop.clear()
        loops = [(self._server.serve_forever, f"fake-{self.name}")]
        if background:
            loops += [
                (self._send_loop, f"fake-{self.name}-webhooks"),
                (self._sweep_loop, f"fake-{self.name}-sweeper"),
            ]
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        with self.changed:
            self.changed.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads = []

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---- controls -----------------------------------------------------------------------------

    def fail_next(self, pattern: str, status: int = 503, times: int = 1) -> None:
        """The next ``times`` REST calls whose ``METHOD /path`` matches ``pattern`` answer ``status``."""
        with self.lock:
            self._fail_next.append((re.compile(pattern), status, times))

    def _inject_faults(self, method: str, path: str) -> None:
        """A REST call's injected failure, if any: ``fail_next`` first, then ``error_rate``."""
        with self.lock:
            for i, (pattern, status, times) in enumerate(self._fail_next):
                if pattern.search(f"{method} {path}"):
                    self._fail_next[i] = (pattern, status, times - 1)
                    if times - 1 <= 0:
                        self._fail_next.pop(i)
                    raise HttpError(status, "injected failure")
            injected = self.error_rate and self.rng.random() < self.error_rate
        if injected:
            raise HttpError(self.rng.choice([500, 502, 503]), "injected server error")

    def job(self, job_id: int) -> Any:
        with self.lock:
            return self.jobs[job_id]

    def count(self, method: str, route_prefix: str = "") -> int:
        with self.lock:
            return sum(1 for m, r, _ in self.calls if m == method and r.startswith(route_prefix))

    def cancel_job(self, job_id: int) -> None:
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        raise NotImplementedError

    def rate_limit_for(self, seconds: float) -> None:
        raise NotImplementedError

    def _queue_from(self, body: dict[str, Any]) -> int:
        """``POST /_fake/jobs``: queue the job ``body`` describes."""
        raise NotImplementedError

    def _job_json(self, job: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _rate_limit_from(self, body: dict[str, Any]) -> None:
        self.rate_limit_for(float(body["rate_limit_seconds"]))

    def _more_faults(self, body: dict[str, Any]) -> None:
        """``POST /_fake/faults``: what only this fake takes (the lock is held)."""

    def _controls(self, method: str, path: str, raw: bytes) -> tuple[int, Any]:
        """``/_fake/``: queue a job, read one, cancel one, the state, the faults."""
        body = json.loads(raw) if raw else {}
        if path == "/_fake/jobs" and method == "POST":
            job_id = self._queue_from(body)
            with self.lock:
                return 201, self._job_json(self.jobs[job_id])
        if (m := re.fullmatch(r"/_fake/jobs/(\d+)", path)) and method == "GET":
            with self.lock:
                job = self.jobs.get(int(m.group(1)))
                if job is None:
                    raise HttpError(404, self.not_found)
                return 200, self._job_json(job)
        if (m := re.fullmatch(r"/_fake/jobs/(\d+)/cancel", path)) and method == "POST":
            self.cancel_job(int(m.group(1)))
            return 202, {}
        if path == "/_fake/state" and method == "GET":
            return 200, self.summary()
        if path == "/_fake/faults" and method == "POST":
            with self.lock:
                for key in self.fault_rates:
                    if key in body:
                        setattr(self, key, float(body[key]))
                self._more_faults(body)
                self.runner_faults.extend(str(f) for f in body.get("runner_faults", []) if f in RUNNER_FAULTS)
            if "rate_limit_seconds" in body:
                self._rate_limit_from(body)
            return 200, {"ok": True}
        raise HttpError(404, self.not_found)

    # ---- HTTP ---------------------------------------------------------------------------------

    def _route(
        self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, Any], raw: bytes
    ) -> tuple[int, Any, dict[str, str]]:
        raise NotImplementedError

    def _record(self, method: str, path: str, route: str, status: int) -> None:
        """Log a call (the lock is held); by default every call, as ``(method, route, status)``."""
        self.calls.append((method, route, status))

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        path = parts.path
        query = {k: (v if k.endswith("[]") else v[-1]) for k, v in parse_qs(parts.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        status: int = 500
        body: Any = {"message": "fake error"}
        headers: dict[str, str] = {}
        try:
            if path.startswith("/_fake/"):
                status, body = self._controls(handler.command, path, raw)
            else:
                status, body, headers = self._route(handler, path, query, raw)
        except HttpError as err:
            status, body, headers = err.status, {"message": err.message}, err.headers
        except Exception as exc:  # a bug in the fake: say so
            status, body = 500, {"message": f"fake: {type(exc).__name__}: {exc}"}
        with self.lock:
            self._record(handler.command, path, re.sub(r"/\d+", "/{id}", path), status)
        data = b"" if status == 204 or body is None else json.dumps(body).encode()
        try:
            handler.send_response(status)
            for name, value in headers.items():
                handler.send_header(name, value)
            if data:
                handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            if data:
                handler.wfile.write(data)
        except OSError:
            pass  # the caller went away (a killed runner's long poll)

    # ---- webhooks -----------------------------------------------------------------------------

    def _may_reorder(self, delivery: Any) -> bool:
        return True

    def _delivery_headers(self, delivery: Any) -> dict[str, str]:
        raise NotImplementedError

    def _send_loop(self) -> None:
        """Send what is queued; a share (``reorder_rate``) of first sends is held back 0.3-1.3 s,
        so a later delivery overtakes it. A duplicate goes out as it came."""
        while not self._stop.is_set():
            with self.changed:
                now = time.time()
                due = [d for d, at in self.held_back if at <= now]
                self.held_back = [(d, at) for d, at in self.held_back if at > now]
                batch = list(self.outbox)
                self.outbox.clear()
                if not batch and not due:
                    self.changed.wait(0.05)
                    continue
            for delivery in due:
                self._post(delivery)
            for delivery, duplicate in batch:
                if not duplicate and self._may_reorder(delivery) and self.rng.random() < self.reorder_rate:
                    with self.lock:
                        self.held_back.append((delivery, time.time() + 0.3 + self.rng.random()))
                    continue
                self._post(delivery)

    def _post(self, delivery: Any) -> None:
        if not self.webhook_url:
            return
        self._sent(delivery, self._http_post)

    def _http_post(self, body: bytes, headers: dict[str, str]) -> int:
        request = urllib.request.Request(self.webhook_url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return 0

    def _sent(self, delivery: Any, transport: Callable[[bytes, dict[str, str]], int]) -> None:
        headers = {"Content-Type": "application/json", **self._delivery_headers(delivery)}
        started = time.time()
        status = transport(delivery.body, headers)
        with self.lock:
            delivery.status_code = status
            delivery.duration = time.time() - started
            delivery.delivered_at = started

    def send_outbox(self, transport: Callable[[bytes, dict[str, str]], int]) -> int:
        """Send what is queued now, in order, through ``transport`` (body, headers -> the HTTP
        status): a simulation's in-process webhook (started with ``background=False``)."""
        with self.lock:
            batch = list(self.outbox)
            self.outbox.clear()
        for delivery, _ in batch:
            self._sent(delivery, transport)
        return len(batch)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(0.25):
            self.sweep()

    def sweep(self) -> None:
        """What the service does on its own as time passes (a lost runner's job failed, ...)."""
        raise NotImplementedError
