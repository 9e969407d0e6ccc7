"""A fake Agent API (and a fake EC2 metadata service) for the agent's tests.

Both run a stdlib ``ThreadingHTTPServer`` on 127.0.0.1 on a free port in a thread, record every
request, and let a test steer them: assign a job, cancel it (via heartbeat or the logs answer),
terminate the machine, refuse a start with 409, revoke the agent token, fail calls with 503,
script the answers to a path, serve a checkpoint, keep uploaded outputs and checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, unquote, urlsplit

PREFIX = "/api/agent/v1/"


@dataclass
class Recorded:
    """One request as the server saw it."""

    method: str
    path: str  # relative to the API prefix, e.g. "jobs/j1/logs"
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any  # JSON, or bytes for files (any other Content-Type)
    at: float = field(default_factory=time.monotonic)
    raw_path: str = ""  # as sent, still percent-quoted


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


class _FakeBase:
    """Server plumbing shared by the fakes: start/stop, recording, waiting for conditions."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.requests: list[Recorded] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # As the agent server: uvicorn runs on asyncio, whose socket transports set
            # TCP_NODELAY on every TCP connection (CPython's asyncio/selector_events.py,
            # _SelectorSocketTransport: base_events._set_nodelay). Without it this server's body,
            # written after its headers, waits for the agent's delayed ACK (40 ms a call).
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                fake._dispatch(self)

            do_GET = do_POST = do_PUT = _handle

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> _FakeBase:
        self._thread.start()
        return self

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        with self.cond:
            self.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
        """Wait until ``predicate()`` is truthy (checked after every request); return its value."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
                self.cond.wait(min(remaining, 0.1))

    def calls(self, method: str, path: str) -> list[Recorded]:
        with self.cond:
            return [r for r in self.requests if r.method == method and r.path == path]

    @staticmethod
    def _reply(
        handler: BaseHTTPRequestHandler,
        status: int,
        body: Any = None,
        text: str | None = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if raw is not None:
            data, kind = raw, "application/gzip"
        elif text is not None:
            data, kind = text.encode(), "text/plain"
        elif body is not None:
            data, kind = json.dumps(body).encode(), "application/json"
        else:
            data, kind = b"", "application/json"
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        if data:
            handler.wfile.write(data)

    def _read(self, handler: BaseHTTPRequestHandler) -> tuple[str, dict[str, list[str]], Any]:
        parts = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        if raw and handler.headers.get("Content-Type", "application/json") != "application/json":
            return parts.path, parse_qs(parts.query), raw  # files: kept as bytes
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        return parts.path, parse_qs(parts.query), body

    def _dispatch(self, handler: BaseHTTPRequestHandler) -> None:
        raise NotImplementedError


class FakeAgentAPI(_FakeBase):
    """The Agent API contract, in memory."""

    def __init__(
        self,
        *,
        heartbeat_interval: float = 0.2,
        poll_timeout: float = 0.5,
        bootstrap_tokens: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__()
        bootstrap_tokens = bootstrap_tokens or ("bootstrap-" + secrets.token_hex(12),)
        self.heartbeat_interval = heartbeat_interval
        self.poll_timeout = poll_timeout
        self.bootstrap_tokens = set(bootstrap_tokens)
        self.used_bootstrap_tokens: set[str] = set()
        self.agent_token = "agent-" + secrets.token_hex(16)
        self.instance_id = "inst-" + secrets.token_hex(4)
        self.revoked = False
        self.queue: deque[dict[str, Any]] = deque()
        self.cancel_ids: set[str] = set()
        self.cancel_via_logs: set[str] = set()
        self.terminate = False
        self.started_status: dict[str, int] = {}
        self.started_delay: dict[str, float] = {}  # job id -> seconds the start's answer takes
        self.started_answered: dict[str, float] = {}  # job id -> when it was answered (time.time())
        self.logs: dict[str, dict[int, tuple[dict[str, Any], float]]] = {}
        self.finished: dict[str, tuple[dict[str, Any], float]] = {}
        self.meta: dict[tuple[str, str], dict[str, Any]] = {}
        self.interruptions: list[dict[str, Any]] = []
        self.fail_next: dict[str, int] = {}  # path -> how many 503s to answer first
        # path -> the next answers, in order: (status, JSON body[, headers]), "drop" (the
        # connection closed, no answer) or None for the normal answer
        self.answers: dict[str, list[Any]] = {}
        self.uploads_done: dict[str, tuple[dict[str, Any], float]] = {}
        # Answer as a control plane from before final_output and awaits_uploads: the jobs it
        # hands out say nothing of final_output, finished answers no awaits_uploads.
        self.older = False
        self.artifacts: dict[str, dict[str, bytes]] = {}  # job id -> name -> content (once each)
        self.artifact_puts: dict[str, list[str]] = {}  # job id -> names, one per accepted PUT
        self.checkpoints: dict[str, list[tuple[bytes, float]]] = {}  # job id -> stored, in order
        self.served_checkpoints: dict[str, bytes] = {}  # job id -> what GET checkpoint answers

    # -- steering ---------------------------------------------------------------------------

    @property
    def bootstrap_token(self) -> str:
        return next(iter(self.bootstrap_tokens))

    def assign(
        self,
        command: str,
        *,
        job_id: str | None = None,
        env: dict[str, str] | None = None,
        timeout_seconds: int = 60,
        attempt: int = 1,
        checkpoint: dict[str, Any] | None = None,
        secret_env_names: list[str] | None = None,
        network: dict[str, Any] | None = None,
        disk_limit_bytes: int | None = None,
        containers: bool = False,
        registries: list[dict[str, str]] | None = None,
        image: str | None = None,
    ) -> str:
        """Hand a job to the next ``GET work``; returns its id. ``checkpoint`` is the payload's
        ``{"available", "interval_seconds"}`` (left out when ``None``, as an older server)."""
        job: dict[str, Any] = {
            "id": job_id or "job-" + secrets.token_hex(4),
            "command": command,
            "env": env or {},
            "timeout_seconds": timeout_seconds,
            "attempt": attempt,
        }
        if checkpoint is not None:
            job["checkpoint"] = checkpoint
        if secret_env_names is not None:
            job["secret_env_names"] = secret_env_names
        if network is not None:
            job["network"] = network
        if disk_limit_bytes is not None:
            job["disk_limit_bytes"] = disk_limit_bytes
        if containers:
            job["containers"] = True
        if registries is not None:
            job["registries"] = registries
        if image is not None:
            job["image"] = {"reference": image}
        if not self.older:
            job["final_output"] = True  # as apps.jobs.selectors.job_payload says
        with self.cond:
            self.queue.append(job)
            self.cond.notify_all()
        return str(job["id"])

    def cancel(self, job_id: str, *, via_logs: bool = False) -> None:
        with self.cond:
            (self.cancel_via_logs if via_logs else self.cancel_ids).add(job_id)

    def output(self, job_id: str, stream: str | None = None) -> str:
        """The job's output so far, in sequence order."""
        with self.cond:
            chunks = sorted(self.logs.get(job_id, {}).values(), key=lambda item: item[0]["seq"])
        return "".join(c["data"] for c, _ in chunks if stream is None or c["stream"] == stream)

    def wait_finished(self, job_id: str, timeout: float = 15.0) -> dict[str, Any]:
        return self.wait_for(
            lambda: self.finished.get(job_id, (None,))[0], timeout, f"job {job_id} to finish"
        )

    def wait_uploads_done(self, job_id: str, timeout: float = 15.0) -> dict[str, Any]:
        return self.wait_for(
            lambda: self.uploads_done.get(job_id, (None,))[0], timeout, f"job {job_id}'s uploads-done"
        )

    def _store_output(self, job_id: str, chunks: list[dict[str, Any]]) -> None:
        """Output chunks, each seq once (a retried post repeats them), as the server keeps them."""
        now = time.monotonic()
        stored = self.logs.setdefault(job_id, {})
        for chunk in chunks:
            stored.setdefault(int(chunk["seq"]), (chunk, now))

    def wait_done(self, job_id: str, timeout: float = 15.0) -> dict[str, Any]:
        """The agent is through with the job: its ``finished`` report, then its ``uploads-done``
        when it announced files, else its next ``GET work`` (it posts no ``uploads-done`` then).
        Returns the ``finished`` report."""
        finished = self.wait_finished(job_id, timeout)
        if finished.get("uploads_pending"):
            self.wait_uploads_done(job_id, timeout)
        else:
            at = self.finished[job_id][1]
            self.wait_for(
                lambda: [r for r in self.calls("GET", "work") if r.at > at], timeout, "polling after the job"
            )
        return finished

    def wait_output(self, job_id: str, text: str, timeout: float = 10.0) -> str:
        return self.wait_for(
            lambda: self.output(job_id) if text in self.output(job_id) else "", timeout, f"{text!r} in output"
        )

    # -- the API ----------------------------------------------------------------------------

    def _dispatch(self, handler: BaseHTTPRequestHandler) -> None:
        path, query, body = self._read(handler)
        rel = path[len(PREFIX) :] if path.startswith(PREFIX) else path
        record = Recorded(
            handler.command, unquote(rel), query, dict(handler.headers.items()), body, raw_path=path
        )
        with self.cond:
            self.requests.append(record)
            self.cond.notify_all()
            failures = self.fail_next.get(record.path, 0)
            if failures:
                self.fail_next[record.path] = failures - 1
            scripted = self.answers.get(record.path)
            answer = scripted.pop(0) if scripted else None
        if failures:
            return self._reply(handler, 503, {"code": "unavailable"})
        if answer == "drop":
            handler.close_connection = True
            return None
        if answer is not None:
            status, body, *headers = answer
            return self._reply(handler, status, body, headers=headers[0] if headers else None)
        if not path.startswith(PREFIX):
            return self._reply(handler, 404, {"code": "not_found"})
        if rel == "enroll" and handler.command == "POST":
            return self._enroll(handler, body or {})
        if self.revoked or handler.headers.get("Authorization") != f"Agent {self.agent_token}":
            return self._reply(handler, 401, {"code": "invalid_agent_token"})
        parts = rel.split("/")
        status, answer = 404, {"code": "not_found"}
        if rel == "heartbeat" and handler.command == "POST":
            with self.cond:
                status, answer = 200, {"cancel": sorted(self.cancel_ids), "terminate": self.terminate}
        elif rel == "work" and handler.command == "GET":
            return self._work(handler, float(query.get("wait", ["0"])[0]))
        elif rel == "interruption" and handler.command == "POST":
            with self.cond:
                self.interruptions.append(body)
                self.cond.notify_all()
            status, answer = 200, {}
        elif len(parts) >= 3 and parts[0] == "jobs":
            job_id = unquote(parts[1])
            if parts[2:] == ["checkpoint"] and handler.command == "GET":
                with self.cond:
                    served = self.served_checkpoints.get(job_id)
                if served is None:
                    return self._reply(handler, 404, {"code": "no_checkpoint"})
                return self._reply(handler, 200, raw=served)
            if handler.command == "PUT":
                status, answer = self._put(job_id, parts[2:], dict(handler.headers.items()), body)
            else:
                status, answer = self._job(handler.command, job_id, parts[2:], body)
        return self._reply(handler, status, answer)

    def _put(
        self, job_id: str, rest: list[str], headers: dict[str, str], body: Any
    ) -> tuple[int, dict[str, Any]]:
        """``PUT artifacts/NAME`` and ``PUT checkpoint``: verify the checksum, keep the bytes."""
        data = body if isinstance(body, bytes) else b""
        digest = hashlib.sha256(data).hexdigest()
        if headers.get("X-Checksum-Sha256") != digest:
            return 400, {"code": "checksum_mismatch"}
        now = time.monotonic()
        with self.cond:
            if rest == ["checkpoint"]:
                self.checkpoints.setdefault(job_id, []).append((data, now))
                self.cond.notify_all()
                return 201, {"size": len(data), "sha256": digest}
            if rest[0] == "artifacts" and len(rest) >= 2:
                name = "/".join(unquote(segment) for segment in rest[1:])
                self.artifacts.setdefault(job_id, {})[name] = data
                self.artifact_puts.setdefault(job_id, []).append(name)
                self.cond.notify_all()
                return 201, {"name": name, "size": len(data), "sha256": digest}
        return 404, {"code": "not_found"}

    def _enroll(self, handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        token = body.get("bootstrap_token")
        with self.cond:
            if token in self.used_bootstrap_tokens:
                return self._reply(handler, 409, {"code": "already_enrolled"})
            if token not in self.bootstrap_tokens:
                return self._reply(handler, 401, {"code": "invalid_bootstrap_token"})
            self.used_bootstrap_tokens.add(token)
        return self._reply(
            handler,
            200,
            {
                "instance_id": self.instance_id,
                "agent_token": self.agent_token,
                "heartbeat_interval": self.heartbeat_interval,
                "poll_timeout": self.poll_timeout,
            },
        )

    def _work(self, handler: BaseHTTPRequestHandler, wait: float) -> None:
        deadline = time.monotonic() + min(wait, self.poll_timeout)
        with self.cond:
            while not self.queue and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
            job = self.queue.popleft() if self.queue else None
        if job is None:
            return self._reply(handler, 204)
        return self._reply(handler, 200, {"job": job})

    def _job(self, method: str, job_id: str, rest: list[str], body: Any) -> tuple[int, dict[str, Any]]:
        action = rest[0]
        if action == "started" and method == "POST":
            time.sleep(self.started_delay.get(job_id, 0.0))
        with self.cond:
            if action == "started" and method == "POST":
                status = self.started_status.get(job_id, 200)
                self.started_answered[job_id] = time.time()
                return status, {} if status == 200 else {"code": "not_assigned"}
            if action == "logs" and method == "POST":
                self._store_output(job_id, body["chunks"])
                return 200, {"cancel": job_id in self.cancel_via_logs}
            if action == "finished" and method == "POST":
                # As apps/control/agent/endpoints.FinishedView: the job's last output first (its
                # payload said final_output; an older server ignored the field), then its end;
                # the machine is held for uploads-done only when files were announced (an older
                # server said neither).
                if not self.older:
                    self._store_output(job_id, body.get("output") or [])
                self.finished[job_id] = (body, time.monotonic())
                answer = {"ok": True, "status": body.get("outcome", "")}
                if not self.older:
                    answer["awaits_uploads"] = bool(body.get("uploads_pending"))
                return 200, answer
            if action == "uploads-done" and method == "POST":
                self.uploads_done[job_id] = (body, time.monotonic())
                return 200, {}
            if action == "meta" and method == "GET" and len(rest) == 2:
                name = unquote(rest[1])
                if (job_id, name) in self.meta:
                    return 200, {"name": name, "metadata": self.meta[(job_id, name)]}
        return 404, {"code": "not_found"}


class FakeIMDS(_FakeBase):
    """The EC2 instance metadata service, IMDSv2 only (a GET without a session token gets 401)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: set[str] = set()
        self.notice: str | None = None
        # Several machines' metadata services on one server: ``{url}/{machine}/latest/...`` is
        # that machine's own, its notice here (each cloud machine asks its own IMDS).
        self.notices: dict[str, str] = {}

    def _dispatch(self, handler: BaseHTTPRequestHandler) -> None:
        path, query, body = self._read(handler)
        machine = ""
        if not path.startswith("/latest/") and path.count("/") >= 2:
            machine, path = path.split("/", 2)[1], "/" + path.split("/", 2)[2]
        with self.cond:
            self.requests.append(Recorded(handler.command, path, query, dict(handler.headers.items()), body))
            self.cond.notify_all()
        if handler.command == "PUT" and path == "/latest/api/token":
            if not handler.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._reply(handler, 400, text="missing ttl")
            token = secrets.token_hex(8)
            with self.cond:
                self.tokens.add(token)
            return self._reply(handler, 200, text=token)
        if handler.command == "GET" and path == "/latest/meta-data/spot/instance-action":
            if handler.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
                return self._reply(handler, 401, text="unauthorized")
            notice = self.notices.get(machine) if machine else self.notice
            if notice is None:
                return self._reply(handler, 404, text="not found")
            return self._reply(handler, 200, text=notice)
        return self._reply(handler, 404, text="not found")
