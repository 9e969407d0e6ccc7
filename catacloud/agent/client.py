"""HTTP client for the Agent API: retries with capped exponential backoff, and secret redaction.

Files (outputs, checkpoints) go up with :meth:`AgentClient.put_file`: streamed from disk with
their SHA-256 in ``X-Checksum-Sha256``, retried a bounded number of times.

Every call except ``enroll`` sends ``Authorization: Agent <agent_token>``. Connection errors,
429 and 5xx answers are retried; any other answer is returned to the caller, except 401 which
raises :class:`Unauthorized` (the agent's credentials are no longer valid: it must stop).

:meth:`AgentClient.unreachable_for` says how long no call has reached the control plane (an
answer other than 429 or 5xx): a local agent ends itself when that outlasts its limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any
from urllib.parse import quote

import requests

from catacloud.agent import AGENT_API_PREFIX
from catacloud.agent.backoff import backoff
from catacloud.agent.netns import Allow
from catacloud.protocol import VERSION as PROTOCOL_VERSION
from catacloud.protocol import (
    AgentError,
    Enroll,
    EnrollAnswer,
    Finished,
    FinishedAnswer,
    HeartbeatAnswer,
    HostAnswer,
    HostCapacity,
    HostEnroll,
    HostEnrollAnswer,
    HostReport,
    ImagesReport,
    JobPayload,
    LogChunk,
    MachineReport,
    Outcome,
    Started,
    Stream,
)

log = logging.getLogger("catacloud.agent")

REDACTED = "[redacted]"
CHUNK = 1024 * 1024
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

    def __init__(
        self, message: str, *, status: int | None = None, code: str = "", retry_after: float | None = None
    ) -> None:
        super().__init__(redact(message))
        self.status = status
        self.code = code
        self.retry_after = retry_after  # seconds the server asked to wait (Retry-After), if it did


class Unauthorized(AgentAPIError):
    """401: the agent token was revoked or is unknown. The agent must stop."""


class Unavailable(AgentAPIError):
    """Connection errors or 5xx answers outlasted the retry budget."""


class Interrupted(AgentAPIError):
    """The agent is stopping; a retry loop gave up early."""


class Gone(AgentAPIError):
    """409 on a job call: the job is no longer this machine's (it was requeued or ended)."""


class EnrollError(AgentAPIError):
    """Enrollment was refused (invalid or already used bootstrap token)."""


# What ``enroll`` answers (the machine's identity and credentials, the timing to use) and one
# assignment from ``GET work``: the protocol's own structures (catacloud/protocol).
Enrollment = EnrollAnswer
Job = JobPayload


def allow_list(entries: Iterable[str]) -> tuple[Allow, ...]:
    """A job's allow list; an entry this agent cannot read is left out (never a wider rule)."""
    allows = []
    for entry in entries:
        try:
            allows.append(Allow.parse(entry))
        except ValueError as exc:
            log.warning("ignoring a network allow entry: %s", exc)
    return tuple(allows)


def sha256_of(fh: IO[bytes], size: int) -> str:
    """Hex SHA-256 of the next ``size`` bytes of ``fh`` (its position moves)."""
    digest = hashlib.sha256()
    remaining = size
    while remaining > 0:
        block = fh.read(min(CHUNK, remaining))
        if not block:
            break
        digest.update(block)
        remaining -= len(block)
    return digest.hexdigest()


class LimitedReader:
    """Exactly ``size`` bytes of an open file, as a request body ``requests`` streams.

    ``len()`` gives ``requests`` the Content-Length; reading stops at ``size`` even if the file
    grew since it was measured.
    """

    def __init__(self, fh: IO[bytes], size: int) -> None:
        self._fh = fh
        self._remaining = size

    def __len__(self) -> int:
        return self._remaining

    def read(self, n: int = -1) -> bytes:
        if self._remaining <= 0:
            return b""
        if n is None or n < 0 or n > self._remaining:
            n = self._remaining
        data = self._fh.read(min(n, CHUNK))
        self._remaining -= len(data)
        return data

    def __iter__(self) -> Iterator[bytes]:
        while True:
            block = self.read(CHUNK)
            if not block:
                return
            yield block


def _retry_after(response: requests.Response) -> float | None:
    """A 429's or 503's ``Retry-After`` in seconds (the delta form; a date is ignored)."""
    try:
        seconds = float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds < 86400 else None


def _code(response: requests.Response) -> str:
    return _field(response, "code")


def _detail(response: requests.Response) -> str:
    return _field(response, "detail")


def _field(response: requests.Response, name: str) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get(name, "")) if isinstance(body, dict) else ""


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
        self._last_contact = time.monotonic()  # the client's creation counts as the first

    def unreachable_for(self) -> float:
        """Seconds since a call last reached the control plane (an answer other than 429 or 5xx)."""
        return time.monotonic() - self._last_contact

    def _answered(self, response: requests.Response) -> requests.Response:
        if response.status_code < 500 and response.status_code != 429:
            self._last_contact = time.monotonic()
        return response

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

    def backoff(self, attempt: int, hint: float | None = None) -> float:
        """Delay before retry number ``attempt`` (0-based): exponential, capped, with jitter;
        never sooner than ``hint`` (the server's Retry-After)."""
        return backoff(attempt, base=self.backoff_base, cap=self.backoff_cap, hint=hint, jitter=(0.75, 1.0))

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
        traceparent: str = "",
    ) -> requests.Response:
        """Send one call, retrying connection errors, 429 and 5xx.

        ``retry_for`` bounds the retrying in seconds (``None``: until ``interrupt`` is set).
        Raises :class:`Unauthorized` on 401 (authenticated calls), :class:`Unavailable` when
        the budget runs out and :class:`Interrupted` when ``interrupt`` is set. ``traceparent``:
        the job's trace, sent back with a report of that job (W3C trace context).
        """
        url = self.base_url + path
        headers = {"traceparent": traceparent} if traceparent else {}
        if auth:
            if not self._token:
                raise Unauthorized("the agent is not enrolled")
            headers["Authorization"] = f"Agent {self._token}"
        deadline = None if retry_for is None else time.monotonic() + retry_for
        attempt = 0
        while True:
            if interrupt is not None and interrupt.is_set():
                raise Interrupted(f"{method} {path}: the agent is stopping")
            hint: float | None = None
            status: int | None = None
            try:
                response = self._answered(
                    self._session().request(
                        method,
                        url,
                        json=body,
                        params=params,
                        headers=headers,
                        timeout=timeout or self.request_timeout,
                    )
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
                status = response.status_code
                problem = f"HTTP {status}"
                hint = _retry_after(response)
            delay = self.backoff(attempt, hint=hint)
            attempt += 1
            if deadline is not None and time.monotonic() + delay > deadline:
                raise Unavailable(
                    f"{method} {path} failed after {attempt} attempts: {problem}",
                    status=status,
                    retry_after=hint,
                )
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
        machine: MachineReport | None = None,
        retry_for: float | None = 600.0,
        interrupt: threading.Event | None = None,
    ) -> Enrollment:
        """Exchange the single-use bootstrap token for this machine's agent token; ``machine``
        says how this machine isolates jobs and which resource limits hold."""
        register_secret(bootstrap_token)
        body = Enroll(
            bootstrap_token=bootstrap_token,
            hostname=hostname,
            agent_version=agent_version,
            protocol=PROTOCOL_VERSION,
            machine=machine or MachineReport(),
        ).to_json()
        response = self.request(
            "POST",
            "enroll",
            body=body,
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
        if response.status_code == 426:
            raise EnrollError(
                f"enrollment refused: {_detail(response) or 'this agent is too old for the control plane'}",
                status=426,
                code=code,
            )
        self._expect_ok(response, "enroll")
        try:
            enrollment = EnrollAnswer.from_json(self._json(response, "enroll"))
        except ValueError as exc:
            raise AgentAPIError(f"enroll: malformed answer ({exc})") from exc
        self.set_token(enrollment.agent_token)
        return enrollment

    def host_enroll(
        self,
        *,
        enrolment_token: str,
        hostname: str,
        capacity: HostCapacity,
        agent_version: str,
        retry_for: float | None = 600.0,
        interrupt: threading.Event | None = None,
    ) -> HostEnrollAnswer:
        """An enrolled host: its enrolment token for its own credential (``catacloud host``)."""
        register_secret(enrolment_token)
        body = HostEnroll(
            enrolment_token=enrolment_token,
            hostname=hostname,
            capacity=capacity,
            agent_version=agent_version,
            protocol=PROTOCOL_VERSION,
        ).to_json()
        response = self.request(
            "POST", "hosts/enroll", body=body, auth=False, retry_for=retry_for, interrupt=interrupt
        )
        if response.status_code in (401, 426):
            raise EnrollError(
                f"enrollment refused: {_detail(response) or _code(response) or response.status_code}",
                status=response.status_code,
                code=_code(response),
            )
        self._expect_ok(response, "hosts/enroll")
        try:
            answer = HostEnrollAnswer.from_json(self._json(response, "hosts/enroll"))
        except ValueError as exc:
            raise AgentAPIError(f"hosts/enroll: malformed answer ({exc})") from exc
        self.set_token(answer.host_token)
        return answer

    def host_exchange(
        self, report: HostReport, *, wait: float, interrupt: threading.Event | None = None
    ) -> HostAnswer:
        """An enrolled host's report for what it starts and stops (waits up to ``wait`` seconds
        while there is nothing to do)."""
        response = self.request(
            "POST",
            "hosts/exchange",
            body=report.to_json(),
            params={"wait": f"{wait:g}"},
            timeout=wait + 10.0,
            retry_for=None,
            interrupt=interrupt,
        )
        self._expect_ok(response, "hosts/exchange")
        try:
            return HostAnswer.from_json(self._json(response, "hosts/exchange"))
        except ValueError as exc:
            raise AgentAPIError(f"hosts/exchange: malformed answer ({exc})") from exc

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
        try:
            answer = HeartbeatAnswer.from_json(self._json(response, "heartbeat"))
        except ValueError as exc:
            raise AgentAPIError(f"heartbeat: malformed answer ({exc})") from exc
        return list(answer.cancel), answer.terminate

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
            return JobPayload.from_json(job)
        except ValueError as exc:
            raise AgentAPIError(f"work: malformed job ({exc})") from exc

    def job_started(
        self,
        job_id: str,
        *,
        interrupt: threading.Event | None = None,
        agent_ms: float = 0.0,
        traceparent: str = "",
    ) -> bool:
        """Claim the start of a job; ``False`` (409) means it is no longer this machine's.
        ``agent_ms``: what this agent spent since the poll's answer arrived."""
        response = self.request(
            "POST",
            f"jobs/{quote(job_id, safe='')}/started",
            body=Started(agent_ms=round(agent_ms, 3)).to_json(),
            interrupt=interrupt,
            traceparent=traceparent,
        )
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
        self,
        job_id: str,
        *,
        exit_code: int | None,
        outcome: Outcome,
        reason: str,
        uploads_pending: int = 0,
        code: str = "",
        retry_for: float = 300.0,
        traceparent: str = "",
        launch_ms: float | None = None,
        network: str = "",
        output: Sequence[Mapping[str, Any]] = (),
    ) -> bool:
        """Report a job's outcome, retrying until acknowledged or ``retry_for`` runs out.
        ``output``: the job's last output chunks (:meth:`LogStreamer.hand_over`), when its
        payload said the control plane takes them here.

        ``uploads_pending`` output files follow; the machine stays the job's until
        :meth:`uploads_done`. ``launch_ms``: from the start's confirmation to the command's
        launch; ``network``: how its network came (``ahead``, ``at start``, ``none``).
        Returns whether the control plane waits for :meth:`uploads_done` (False: it released
        the machine with this report).
        """
        response = self.request(
            "POST",
            f"jobs/{quote(job_id, safe='')}/finished",
            body=Finished(
                outcome=outcome,
                exit_code=exit_code,
                reason=reason,
                uploads_pending=uploads_pending,
                code=code,
                launch_ms=launch_ms,
                network=network,
                output=tuple(
                    LogChunk(seq=c["seq"], stream=Stream(c["stream"]), data=c["data"]) for c in output
                ),
            ).to_json(),
            retry_for=retry_for,
            traceparent=traceparent,
        )
        self._expect_ok(response, "finished")
        try:
            return FinishedAnswer.from_json(self._json(response, "finished")).awaits_uploads
        except (AgentAPIError, ValueError):
            return True  # an answer it cannot read: post uploads-done, as before the field

    def report_images(
        self, report: ImagesReport, *, job_id: str | None = None, retry_for: float = 30.0
    ) -> None:
        """What the machine pulled (a pool member's images before it is ready, or ``job_id``'s
        image) and everything its store holds."""
        path = f"jobs/{quote(job_id, safe='')}/image" if job_id else "images"
        response = self.request("POST", path, body=report.to_json(), retry_for=retry_for)
        if response.status_code == 409:
            raise Gone(f"{path}: HTTP 409 " + _code(response), status=409, code=_code(response))
        self._expect_ok(response, path)

    def uploads_done(self, job_id: str, failed: list[dict[str, str]], *, retry_for: float = 300.0) -> None:
        """The output uploads are over (``failed`` lists the files that did not make it)."""
        response = self.request(
            "POST",
            f"jobs/{quote(job_id, safe='')}/uploads-done",
            body={"failed": failed},
            retry_for=retry_for,
        )
        if response.status_code == 409:
            raise Gone("uploads-done: HTTP 409 " + _code(response), status=409, code=_code(response))
        self._expect_ok(response, "uploads-done")

    def put_file(
        self,
        path: str,
        file_path: str,
        *,
        content_type: str,
        attempts: int = 5,
        deadline: float | None = None,
        interrupt: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Upload a file with ``PUT``, streamed, with its ``X-Checksum-Sha256``; the JSON answer.

        Connection errors, 429, 5xx and ``400 checksum_mismatch`` are retried (at most
        ``attempts`` tries, none starting after ``deadline`` on the monotonic clock); 409 raises
        :class:`Gone`, 401 :class:`Unauthorized`, any other refusal :class:`AgentAPIError`.
        """
        if not self._token:
            raise Unauthorized("the agent is not enrolled")
        url = self.base_url + path
        problem = "not attempted"
        tries = 0
        for attempt in range(attempts):
            if attempt:
                delay = self.backoff(attempt - 1)
                if deadline is not None and time.monotonic() + delay > deadline:
                    break
                log.warning("PUT %s: %s; retrying in %.1f s", path, redact(problem), delay)
                if interrupt is not None:
                    if interrupt.wait(delay):
                        raise Interrupted(f"PUT {path}: given up ({problem})")
                else:
                    time.sleep(delay)
            tries += 1
            try:
                # Never follow a link the job planted where a file was listed.
                with open(os.open(file_path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    checksum = sha256_of(fh, size)
                    fh.seek(0)
                    headers = {
                        "Authorization": f"Agent {self._token}",
                        "Content-Type": content_type,
                        "Content-Length": str(size),
                        "X-Checksum-Sha256": checksum,
                    }
                    # (an empty body as bytes: requests would send a 0-length stream chunked)
                    body: LimitedReader | bytes = LimitedReader(fh, size) if size else b""
                    response = self._answered(
                        self._session().put(url, data=body, headers=headers, timeout=self.request_timeout)
                    )
            except requests.RequestException as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            code = _code(response)
            if response.status_code == 401:
                raise Unauthorized(f"PUT {path}: 401 {code or 'unauthorized'}", status=401)
            if response.status_code == 409:
                raise Gone(f"PUT {path}: HTTP 409 {code}".rstrip(), status=409, code=code)
            if response.status_code == 400 and code == AgentError.CHECKSUM_MISMATCH:
                problem = "the control plane saw a different checksum"
                continue
            if response.status_code >= 500 or response.status_code == 429:
                problem = f"HTTP {response.status_code}"
                continue
            self._expect_ok(response, f"PUT {path}")
            try:
                data = response.json()
            except ValueError:
                data = {}
            return data if isinstance(data, dict) else {}
        raise Unavailable(f"PUT {path} failed after {tries} attempts: {problem}")

    def put_artifact(
        self, job_id: str, url_name: str, file_path: str, *, deadline: float | None = None
    ) -> dict[str, Any]:
        """Upload one output file; ``url_name`` is already quoted segment by segment."""
        return self.put_file(
            f"jobs/{quote(job_id, safe='')}/artifacts/{url_name}",
            file_path,
            content_type="application/octet-stream",
            deadline=deadline,
        )

    def put_checkpoint(
        self, job_id: str, archive: str, *, interrupt: threading.Event | None = None
    ) -> dict[str, Any]:
        """Upload the job's checkpoint (a tar.gz), replacing the previous one."""
        return self.put_file(
            f"jobs/{quote(job_id, safe='')}/checkpoint",
            archive,
            content_type="application/gzip",
            interrupt=interrupt,
        )

    def get_checkpoint(self, job_id: str, dest: str) -> bool:
        """Download the job's last checkpoint into the file ``dest``; ``False`` when there is none.

        One try: raises :class:`AgentAPIError` on failure (the caller decides on retries).
        """
        if not self._token:
            raise Unauthorized("the agent is not enrolled")
        path = f"jobs/{quote(job_id, safe='')}/checkpoint"
        try:
            with self._session().get(
                self.base_url + path,
                headers={"Authorization": f"Agent {self._token}"},
                timeout=self.request_timeout,
                stream=True,
            ) as response:
                self._answered(response)
                if response.status_code == 401:
                    raise Unauthorized(f"GET {path}: 401 {_code(response) or 'unauthorized'}", status=401)
                if response.status_code == 404:
                    return False
                self._expect_ok(response, f"GET {path}")
                with open(dest, "wb") as fh:
                    for block in response.iter_content(CHUNK):
                        fh.write(block)
        except requests.RequestException as exc:
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise Unavailable(f"GET {path}: {type(exc).__name__}: {exc}") from exc
        return True

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
