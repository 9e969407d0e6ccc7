"""HTTP client for the Agent API: retries with capped exponential backoff, and secret redaction.

Every call except ``enroll`` sends ``Authorization: Agent <agent_token>``. Connection errors,
429 and 5xx answers are retried; any other answer is returned to the caller, except 401 which
raises :class:`Unauthorized` (the agent's credentials are no longer valid: it must stop).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests

from catacloud.agent import AGENT_API_PREFIX

log = logging.getLogger("catacloud.agent")

REDACTED = "[redacted]"
_secrets: set[str] = set()
_secrets_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Remember a secret so :func:`redact` hides it from every log line and message."""
    if value and len(value) >= 4:
        with _secrets_lock:
            _secrets.add(value)


def forget_secret(value: str | None) -> None:
    """Stop redacting a secret that no longer exists (a finished job's nonce)."""
    with _secrets_lock:
        _secrets.discard(value or "")


def redact(text: str) -> str:
    """``text`` with every registered secret replaced, longest first."""
    with _secrets_lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


class RedactingFormatter(logging.Formatter):
    """A formatter whose output (message, arguments, traceback) never contains a secret."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class AgentAPIError(Exception):
    """The Agent API refused a call, or could not be reached in time."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "") -> None:
        super().__init__(redact(message))
        self.status = status
        self.code = code


class Unauthorized(AgentAPIError):
    """401: the agent token was revoked or is unknown. The agent must stop."""


class Unavailable(AgentAPIError):
    """Connection errors or 5xx answers outlasted the retry budget."""


class Interrupted(AgentAPIError):
    """The agent is stopping; a retry loop gave up early."""


class EnrollError(AgentAPIError):
    """Enrollment was refused (invalid or already used bootstrap token)."""


@dataclass(frozen=True)
class Enrollment:
    """What ``enroll`` answers: this machine's identity and credentials, and the timing to use."""

    instance_id: str
    agent_token: str
    heartbeat_interval: float
    poll_timeout: float


@dataclass(frozen=True)
class Job:
    """One assignment from ``GET work``."""

    id: str
    command: str
    env: dict[str, str]
    timeout_seconds: int
    attempt: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        return cls(
            id=str(data["id"]),
            command=str(data["command"]),
            env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            timeout_seconds=int(data.get("timeout_seconds") or 0),
            attempt=int(data.get("attempt") or 0),
        )


def _code(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get("code", "")) if isinstance(body, dict) else ""


class AgentClient:
    """Thread-safe Agent API client (one ``requests.Session`` per thread)."""

    def __init__(
        self,
        base_url: str,
        *,
        user_agent: str = "catacloud-agent",
        request_timeout: float = 15.0,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/") + AGENT_API_PREFIX
        self.user_agent = user_agent
        self.request_timeout = request_timeout
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._token: str | None = None
        self._local = threading.local()

    # -- plumbing ---------------------------------------------------------------------------

    def set_token(self, token: str) -> None:
        register_secret(token)
        self._token = token

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.headers["User-Agent"] = self.user_agent
            self._local.session = session
        return session

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (0-based): exponential, capped, with jitter."""
        delay = min(self.backoff_cap, self.backoff_base * (2 ** min(attempt, 20)))
        return delay * random.uniform(0.75, 1.0)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        retry_for: float | None = 60.0,
        auth: bool = True,
        interrupt: threading.Event | None = None,
    ) -> requests.Response:
        """Send one call, retrying connection errors, 429 and 5xx.

        ``retry_for`` bounds the retrying in seconds (``None``: until ``interrupt`` is set).
        Raises :class:`Unauthorized` on 401 (authenticated calls), :class:`Unavailable` when
        the budget runs out and :class:`Interrupted` when ``interrupt`` is set.
        """
        url = self.base_url + path
        headers = {}
        if auth:
            if not self._token:
                raise Unauthorized("the agent is not enrolled")
            headers["Authorization"] = f"Agent {self._token}"
        deadline = None if retry_for is None else time.monotonic() + retry_for
        attempt = 0
        while True:
            if interrupt is not None and interrupt.is_set():
                raise Interrupted(f"{method} {path}: the agent is stopping")
            try:
                response = self._session().request(
                    method,
                    url,
                    json=body,
                    params=params,
                    headers=headers,
                    timeout=timeout or self.request_timeout,
                )
            except requests.RequestException as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 401 and auth:
                    raise Unauthorized(
                        f"{method} {path}: 401 {_code(response) or 'unauthorized'}", status=401
                    )
                if response.status_code < 500 and response.status_code != 429:
                    return response
                problem = f"HTTP {response.status_code}"
            delay = self.backoff(attempt)
            attempt += 1
            if deadline is not None and time.monotonic() + delay > deadline:
                raise Unavailable(f"{method} {path} failed after {attempt} attempts: {problem}")
            log.warning("%s %s: %s; retrying in %.1f s", method, path, redact(problem), delay)
            if interrupt is not None:
                if interrupt.wait(delay):
                    raise Interrupted(f"{method} {path}: the agent is stopping")
            else:
                time.sleep(delay)

    @staticmethod
    def _json(response: requests.Response, what: str) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError as exc:
            raise AgentAPIError(f"{what}: the answer is not JSON", status=response.status_code) from exc
        if not isinstance(data, dict):
            raise AgentAPIError(f"{what}: the answer is not a JSON object", status=response.status_code)
        return data

    def _expect_ok(self, response: requests.Response, what: str) -> None:
        if response.status_code >= 300:
            raise AgentAPIError(
                f"{what}: HTTP {response.status_code} {_code(response)}".rstrip(),
                status=response.status_code,
                code=_code(response),
            )

    # -- the calls --------------------------------------------------------------------------

    def enroll(
        self,
        *,
        bootstrap_token: str,
        hostname: str,
        agent_version: str,
        retry_for: float | None = 600.0,
        interrupt: threading.Event | None = None,
    ) -> Enrollment:
        """Exchange the single-use bootstrap token for this machine's agent token."""
        register_secret(bootstrap_token)
        response = self.request(
            "POST",
            "enroll",
            body={"bootstrap_token": bootstrap_token, "hostname": hostname, "agent_version": agent_version},
            auth=False,
            retry_for=retry_for,
            interrupt=interrupt,
        )
        code = _code(response)
        if response.status_code == 401:
            raise EnrollError(
                f"enrollment refused: the bootstrap token is invalid ({code or 'HTTP 401'})",
                status=401,
                code=code,
            )
        if response.status_code == 409:
            raise EnrollError(
                "enrollment refused: this bootstrap token was already used "
                f"(bootstrap tokens are single-use; {code or 'HTTP 409'})",
                status=409,
                code=code,
            )
        self._expect_ok(response, "enroll")
        data = self._json(response, "enroll")
        try:
            enrollment = Enrollment(
                instance_id=str(data["instance_id"]),
                agent_token=str(data["agent_token"]),
                heartbeat_interval=float(data["heartbeat_interval"]),
                poll_timeout=float(data["poll_timeout"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentAPIError(f"enroll: malformed answer ({type(exc).__name__}: {exc})") from exc
        self.set_token(enrollment.agent_token)
        return enrollment

    def heartbeat(
        self,
        running_job: str | None,
        *,
        retry_for: float | None = 0.0,
        interrupt: threading.Event | None = None,
    ) -> tuple[list[str], bool]:
        """Report liveness; answers (job ids to cancel, terminate?)."""
        response = self.request(
            "POST", "heartbeat", body={"running_job": running_job}, retry_for=retry_for, interrupt=interrupt
        )
        self._expect_ok(response, "heartbeat")
        data = self._json(response, "heartbeat")
        cancel = [str(job_id) for job_id in data.get("cancel") or []]
        return cancel, bool(data.get("terminate"))

    def poll_work(self, wait: float, *, interrupt: threading.Event | None = None) -> Job | None:
        """Long-poll for an assignment; ``None`` when nothing came within ``wait`` seconds."""
        response = self.request(
            "GET",
            "work",
            params={"wait": f"{wait:g}"},
            timeout=wait + 10.0,
            retry_for=None,
            interrupt=interrupt,
        )
        if response.status_code == 204:
            return None
        self._expect_ok(response, "work")
        job = self._json(response, "work").get("job")
        if not job:
            return None
        try:
            return Job.from_json(job)
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentAPIError(f"work: malformed job ({type(exc).__name__}: {exc})") from exc

    def job_started(self, job_id: str, *, interrupt: threading.Event | None = None) -> bool:
        """Claim the start of a job; ``False`` (409) means it is no longer this machine's."""
        response = self.request("POST", f"jobs/{quote(job_id, safe='')}/started", interrupt=interrupt)
        if response.status_code == 409:
            return False
        self._expect_ok(response, "started")
        return True

    def send_logs(self, job_id: str, chunks: list[dict[str, Any]], *, retry_for: float = 0.0) -> bool:
        """Ship output chunks; answers whether the job should be cancelled."""
        response = self.request(
            "POST", f"jobs/{quote(job_id, safe='')}/logs", body={"chunks": chunks}, retry_for=retry_for
        )
        self._expect_ok(response, "logs")
        return bool(self._json(response, "logs").get("cancel"))

    def job_finished(
        self, job_id: str, *, exit_code: int | None, outcome: str, reason: str, retry_for: float = 300.0
    ) -> None:
        """Report a job's outcome, retrying until acknowledged or ``retry_for`` runs out."""
        response = self.request(
            "POST",
            f"jobs/{quote(job_id, safe='')}/finished",
            body={"exit_code": exit_code, "outcome": outcome, "reason": reason},
            retry_for=retry_for,
        )
        self._expect_ok(response, "finished")

    def job_meta(self, job_id: str, name: str) -> tuple[int, dict[str, Any]]:
        """Metadata of a resource the job acquired: (HTTP status, JSON body)."""
        response = self.request(
            "GET", f"jobs/{quote(job_id, safe='')}/meta/{quote(name, safe='')}", retry_for=10.0
        )
        try:
            data = response.json()
        except ValueError:
            data = {}
        return response.status_code, data if isinstance(data, dict) else {}

    def interruption(self, kind: str, detail: str, *, retry_for: float = 60.0) -> None:
        """Tell the control plane the cloud is about to take this machine away."""
        response = self.request(
            "POST", "interruption", body={"kind": kind, "detail": detail}, retry_for=retry_for
        )
        self._expect_ok(response, "interruption")
