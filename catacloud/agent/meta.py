"""``catacloud job-meta`` and ``catacloud checkpoint``: the job talking to its agent.

The agent listens on a Unix socket (mode 0600, owned by the running job's uid while it runs, so
that uid and no other may connect; a sandboxed job finds it at ``/run/catacloud/agent.sock``) and
answers, for the job that is running now, if the request carries that job's
``CATACLOUD_JOB_TOKEN`` (``Authorization: Bearer <token>``):

- ``GET /v1/meta/NAME``: a resource's metadata, fetched from the Agent API with the agent's own
  token, which the job never sees. Nothing is written to disk.
- ``POST /v1/checkpoint``: save the checkpoint directory now; answered once it is stored.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import logging
import os
import socket
import socketserver
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import quote, unquote

from catacloud.agent.client import AgentAPIError, redact
from catacloud.protocol import AgentError

log = logging.getLogger("catacloud.agent")

SOCKET_ENV = "CATACLOUD_AGENT_SOCKET"
TOKEN_ENV = "CATACLOUD_JOB_TOKEN"
PATH_PREFIX = "/v1/meta/"
CHECKPOINT_PATH = "/v1/checkpoint"


@dataclass(frozen=True)
class JobGrant:
    """The running job and the nonce its requests must carry."""

    job_id: str
    token: str


# fetch(job_id, name) -> (HTTP status, JSON body) from the Agent API.
Fetch = Callable[[str, str], tuple[int, dict[str, Any]]]
# checkpoint(job_id) -> (HTTP status, JSON body) once the checkpoint is stored (or not).
Checkpoint = Callable[[str], tuple[int, dict[str, Any]]]


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, meta: MetaServer) -> None:
        self.meta = meta
        super().__init__(path, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "catacloud-agent"
    sys_version = ""
    protocol_version = "HTTP/1.0"

    def address_string(self) -> str:
        return "job"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("job-meta: " + format, *args)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        status, body = self.server.meta.handle(self.path, self.headers.get("Authorization", ""))
        self._reply(status, body)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= 65536:
            self.rfile.read(length)  # no body is expected; read what came
        status, body = self.server.meta.handle_post(self.path, self.headers.get("Authorization", ""))
        self._reply(status, body)


_INVALID_TOKEN = {
    "code": AgentError.INVALID_JOB_TOKEN,
    "detail": "CATACLOUD_JOB_TOKEN is missing, wrong, or its job is no longer running",
}


class MetaServer:
    """The agent's side: a tiny HTTP server on a private Unix socket."""

    def __init__(
        self,
        fetch: Fetch,
        *,
        checkpoint: Checkpoint | None = None,
        directory: str | None = None,
    ) -> None:
        self._fetch = fetch
        self._checkpoint = checkpoint
        self._grant: JobGrant | None = None
        self._lock = threading.Lock()
        self.directory = directory or tempfile.mkdtemp(prefix="catacloud-agent-")
        self.path = os.path.join(self.directory, "agent.sock")
        if os.path.lexists(self.path):
            os.unlink(self.path)
        # Bound under a 0077 umask: nobody else can reach the socket between bind and chmod.
        old_umask = os.umask(0o077)
        try:
            self._server = _Server(self.path, self)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="job-meta", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop serving and remove the socket and its directory."""
        if self._thread.is_alive():
            self._server.shutdown()  # waits for serve_forever, which must have started
        self._server.server_close()
        for remove in (lambda: os.unlink(self.path), lambda: os.rmdir(self.directory)):
            with contextlib.suppress(OSError):
                remove()

    def grant(self, job_id: str, token: str, *, uid: int | None = None) -> None:
        """From now on, requests with ``token`` read ``job_id``'s metadata. With ``uid`` (a job
        running as another uid) the socket becomes that uid's (mode 0600): only it may connect."""
        with self._lock:
            self._grant = JobGrant(job_id, token)
            if uid is not None:
                os.chown(self.path, uid, uid)

    def revoke(self) -> None:
        """The job ended: its token is no longer accepted, its uid no longer connects."""
        with self._lock:
            self._grant = None
            if os.stat(self.path).st_uid != os.geteuid():
                os.chown(self.path, os.geteuid(), os.getegid())

    def _authorize(self, authorization: str) -> JobGrant | None:
        """The running job's grant if ``authorization`` carries its token."""
        scheme, _, given = authorization.partition(" ")
        with self._lock:
            grant = self._grant
        if (
            grant is None
            or scheme.lower() != "bearer"
            or not hmac.compare_digest(given.strip().encode(), grant.token.encode())
        ):
            return None
        return grant

    def handle_post(self, path: str, authorization: str) -> tuple[int, dict[str, Any]]:
        """Answer one ``POST`` (only ``/v1/checkpoint``): (HTTP status, JSON body)."""
        if path.split("?", 1)[0] != CHECKPOINT_PATH or self._checkpoint is None:
            return 404, {"code": AgentError.NOT_FOUND, "detail": f"use POST {CHECKPOINT_PATH}"}
        grant = self._authorize(authorization)
        if grant is None:
            return 401, _INVALID_TOKEN
        return self._checkpoint(grant.job_id)

    def handle(self, path: str, authorization: str) -> tuple[int, dict[str, Any]]:
        """Answer one ``GET``: (HTTP status, JSON body)."""
        if not path.startswith(PATH_PREFIX) or len(path) == len(PATH_PREFIX):
            return 404, {"code": AgentError.NOT_FOUND, "detail": "use GET /v1/meta/NAME"}
        name = unquote(path[len(PATH_PREFIX) :].split("?", 1)[0])
        grant = self._authorize(authorization)
        if grant is None:
            return 401, _INVALID_TOKEN
        try:
            status, body = self._fetch(grant.job_id, name)
        except AgentAPIError as exc:
            log.warning("job-meta %r: the Agent API failed: %s", name, exc)
            return 502, {
                "code": AgentError.UPSTREAM_ERROR,
                "detail": "the control plane could not be reached",
            }
        if status == 200:
            return 200, body
        if status == 404:
            return 404, {"code": AgentError.NOT_FOUND, "detail": f"this job has no resource named {name!r}"}
        return 502, {"code": AgentError.UPSTREAM_ERROR, "detail": f"the control plane answered HTTP {status}"}


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def call_agent(
    method: str, path: str, *, socket_path: str, token: str, timeout: float = 30.0
) -> tuple[int, dict[str, Any]]:
    """The job's side: one request to the agent over its socket; (HTTP status, JSON body)."""
    connection = _UnixHTTPConnection(socket_path, timeout)
    try:
        connection.request(method, path, headers={"Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        body = {}
    return response.status, body if isinstance(body, dict) else {}


def fetch_meta(
    name: str, *, socket_path: str, token: str, timeout: float = 30.0
) -> tuple[int, dict[str, Any]]:
    """Ask the agent for ``name``'s metadata; (HTTP status, JSON body)."""
    return call_agent(
        "GET", PATH_PREFIX + quote(name, safe=""), socket_path=socket_path, token=token, timeout=timeout
    )


def job_meta_command(name: str, *, environ: Mapping[str, str] | None = None) -> int:
    """``catacloud job-meta NAME``: print the metadata as JSON (exit 0) or an error (exit 1)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    socket_path = env.get(SOCKET_ENV, "")
    token = env.get(TOKEN_ENV, "")
    if not socket_path:
        print(f"job-meta: {SOCKET_ENV} is not set; run this inside a Catacloud job", file=sys.stderr)
        return 1
    if not token:
        print(f"job-meta: {TOKEN_ENV} is not set; run this inside a Catacloud job", file=sys.stderr)
        return 1
    try:
        status, body = fetch_meta(name, socket_path=socket_path, token=token)
    except OSError as exc:
        print(f"job-meta: cannot reach the agent at {socket_path}: {exc}", file=sys.stderr)
        return 1
    if status == 200 and isinstance(body.get("metadata"), dict):
        print(json.dumps(body["metadata"], indent=2, sort_keys=True))
        return 0
    detail = body.get("detail") or body.get("code") or f"HTTP {status}"
    print(f"job-meta: {name}: {redact(str(detail))}", file=sys.stderr)
    return 1
