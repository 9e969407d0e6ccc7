"""A stateful fake of GitHub for GitHub Actions on Catacloud: the REST endpoints Catacloud
calls, a webhook sender, and the runner side a stand-in runner (``testkit/github_runner``)
talks to. Standard library plus PyJWT (a dependency of Catacloud), so ``make dev`` can run it
as a process (``python -m testkit.github_fake``) and tests in a thread::

    fake = FakeGitHub(app_id=1, public_key=pem, webhook_secret="s3cret", webhook_url=url).start()
    fake.add_installation(42, "acme", ["acme/app"])
    job_id = fake.queue_job("acme/app", ["self-hosted", "catacloud-linux-2cpu"], ["echo hi"])
    ...
    fake.stop()

REST (``fake.url`` is the API base): ``POST /app/installations/{id}/access_tokens`` (the App's
RS256 JWT checked: issuer, at most 10 minutes, not expired), ``GET /installation/repositories``,
``POST /orgs/{org}/actions/runners/generate-jitconfig`` and the ``/repos/{o}/{r}`` one (409 on a
name that exists, 422 without ``runner_group_id`` or without 1-100 labels), runners list / get /
DELETE (422 while busy), workflow runs (``?status=``), a run's jobs, a job, a run's cancel,
``GET /app/hook/deliveries`` and ``POST /app/hook/deliveries/{id}/attempts`` (redelivery). Every
answer carries ``x-ratelimit-*``; faults: a 5xx rate, ``fail_next``, latency, a rate-limit window
(primary or secondary with ``Retry-After``).

GitHub's limits, as its documentation states them, and so does this fake (``limits``; a test may
shrink them, and ``time_scale`` makes every window and wait that many times shorter: a simulated
clock for a week or an hour of traffic in seconds):

- **Primary**: an installation's token gets 5,000 calls an hour, 50 more for each repository
  above 20, at most 12,500 (docs.github.com, "Rate limits for the REST API": *Primary rate
  limit for GitHub App installations*); past it, 403 with ``x-ratelimit-remaining: 0`` and
  the reset.
- **Secondary, points per endpoint**: at most 900 points a minute for one REST endpoint, a
  GET/HEAD/OPTIONS costing 1 point and a POST/PATCH/PUT/DELETE 5 (same page, *Calculating
  points for the secondary rate limit*): 180 ``generate-jitconfig`` calls a minute.
- **Secondary, content creation**: at most 80 content-creating requests a minute and 500 an
  hour (same page, *About secondary rate limits*); a just-in-time runner registration counts.
- **The secondary answer**: 403 or 429 with ``You have exceeded a secondary rate limit``, with
  a ``retry-after`` header or without one (same page, *Exceeding the rate limit*: "If the
  retry-after response header is present, you should not retry your request until after that
  many seconds has elapsed ... Otherwise, wait for at least one minute before retrying";
  continuing while limited "may result in the banning of your integration"). The fake
  answers in turn with retry-after, bare 403 and bare 429 (``secondary_styles``) and records
  every call to an endpoint sooner than its wait in ``limit_violations``. ``secondary_rate``
  answers that share of calls with a secondary limit anyway ("you may also encounter a
  secondary rate limit for undisclosed reasons").
- **Deliveries**: ``GET /app/hook/deliveries`` answers at most ``per_page`` (100) newest first,
  the next page by ``cursor`` named in a ``Link: <...>; rel="next"`` header (REST docs, *List
  deliveries for an app webhook*).
- **User accounts**: an App installed on a user has no ``/orgs/{login}`` (404): its runners are
  repository runners (REST docs, *Self-hosted runners*: organization endpoints).
- **Runner groups**: an organization's runners are in a group; the Default group (id 1) serves
  private repositories only unless public ones are allowed (docs, *Managing access to
  self-hosted runners using groups*: "By default, runner groups only allow access to private
  repositories"; the API's ``allows_public_repositories``), so an organization runner in it is
  never given a public repository's job. A repository runner serves its repository.
- **A dead runner's job** fails once its runner has been silent for ``lost_after`` (600 s: the
  job ends "The self-hosted runner ... lost communication with the server" after about ten
  minutes).

Webhooks: ``workflow_job`` queued / in_progress / completed, signed with ``X-Hub-Signature-256``
like GitHub, with injectable drops (``lost``: never sent nor listed; ``failed``: listed as a failed
delivery, redeliverable), duplicates and reordering.

Runners: ``generate-jitconfig`` returns a base64 JSON config naming this fake and a per-runner
secret. A runner opens a session (online), long-polls for a job and is handed the oldest queued
job whose labels it has (ANY such job, as GitHub does), reports the job's end and is removed
(just-in-time: one job). ``runner_faults`` makes the next configs' runners crash, hang or never
connect, or speak for a runner version GitHub no longer accepts (``deprecated``: the listener
then exits as actions/runner does, 7 with ``ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1``).
A busy runner silent for ``lost_after`` seconds fails its job; one silent for ``offline_after``
reads offline.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import itertools
import json
import re
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import jwt

from testkit.forge_fake import FakeForge, HttpError, clock, iso

# GitHub's documented limits (the module docstring): a test may shrink a fake's ``limits``.
LIMITS = {
    "primary": 5000,  # an installation's calls an hour
    "primary_per_repo": 50,  # more an hour per repository above 20
    "primary_max": 12500,
    "endpoint_points_per_minute": 900,  # GET 1 point, POST/PATCH/PUT/DELETE 5
    "creations_per_minute": 80,
    "creations_per_hour": 500,
}
DEPRECATED_MESSAGE = "Runner version v2.300.0 is deprecated and cannot receive messages."
SECONDARY_WAIT = 60.0  # "wait for at least one minute before retrying" (no retry-after)
SECONDARY_STYLES = ("retry_after", "bare_403", "bare_429")
SECONDARY_MESSAGE = (
    "You have exceeded a secondary rate limit. Please wait a few minutes before you try again. "
    "If you reach out to GitHub Support for help, please include the request ID."
)
# Requests that create content (count against the content-creation limit).
CREATING = re.compile(r"POST /(orgs/[^/]+|repos/[^/]+/[^/]+)/actions/runners/generate-jitconfig")


def endpoint_of(method: str, path: str) -> str:
    """A call's REST endpoint, what GitHub counts points per: its route, with the owner, the
    repository and ids as placeholders (``POST /repos/{owner}/{repo}/actions/runners/...``)."""
    path = re.sub(r"^/repos/[^/]+/[^/]+", "/repos/{owner}/{repo}", path)
    path = re.sub(r"^/orgs/[^/]+", "/orgs/{org}", path)
    return f"{method} " + re.sub(r"/[0-9]+(?=/|$)", "/{id}", path)


def app_keypair() -> tuple[str, str]:
    """A fresh RSA key pair for a test App: (private PEM, public PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    return private, public


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


@dataclass
class Job:
    id: int
    run_id: int
    run_attempt: int
    repository: str
    installation_id: int
    workflow: str
    name: str
    labels: list[str]
    steps: list[str]
    container: str | None = None  # the job's ``container:`` image (its steps run in it)
    services: dict[str, str] = field(default_factory=dict)  # ``services:``, name -> image
    status: str = "queued"
    conclusion: str | None = None
    runner_id: int | None = None
    runner_name: str | None = None
    created_at: float = field(default_factory=clock)
    started_at: float | None = None
    completed_at: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "run_id": self.run_id,
            "run_attempt": self.run_attempt,
            "workflow_name": self.workflow,
            "name": self.name,
            "labels": list(self.labels),
            "status": self.status,
            "conclusion": self.conclusion,
            "runner_id": self.runner_id,
            "runner_name": self.runner_name,
            "runner_group_id": 1 if self.runner_id else None,
            "created_at": iso(self.created_at),
            "started_at": iso(self.started_at or self.created_at),
            "completed_at": iso(self.completed_at),
            "head_sha": "0" * 40,
            "steps": [],
        }


@dataclass
class Runner:
    id: int
    name: str
    labels: list[str]
    group: int
    installation_id: int
    owner: str  # "org:acme" or "repo:acme/app"
    secret: str
    fault: str | None
    session: bool = False
    last_seen: float = 0.0
    job_id: int | None = None
    registered_at: float = field(default_factory=clock)
    online_at: float | None = None

    def status(self, now: float, offline_after: float) -> str:
        return "online" if self.session and now - self.last_seen < offline_after else "offline"

    def as_json(self, now: float, offline_after: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "os": "Linux",
            "status": self.status(now, offline_after),
            "busy": self.job_id is not None,
            "runner_group_id": self.group,
            "labels": [{"id": i + 1, "name": label, "type": "custom"} for i, label in enumerate(self.labels)],
        }


@dataclass
class Delivery:
    id: int
    guid: str
    event: str
    action: str
    installation_id: int
    body: bytes
    redelivery: bool = False
    status_code: int = 0
    delivered_at: float = field(default_factory=clock)
    duration: float = 0.0

    def as_json(self) -> dict[str, Any]:
        ok = 200 <= self.status_code < 300
        return {
            "id": self.id,
            "guid": self.guid,
            "delivered_at": iso(self.delivered_at),
            "redelivery": self.redelivery,
            "duration": round(self.duration, 3),
            "status": "OK"
            if ok
            else (f"Invalid HTTP Response: {self.status_code}" if self.status_code else "failed"),
            "status_code": self.status_code,
            "event": self.event,
            "action": self.action,
            "installation_id": self.installation_id,
            "repository_id": None,
        }


class FakeGitHub(FakeForge):
    """The fake. Thread-safe; ``calls`` records ``(method, route, status)`` of every call."""

    name = "github"
    fault_rates = (*FakeForge.fault_rates, "drop_rate")

    def __init__(
        self,
        *,
        app_id: int = 1,
        public_key: str | bytes = b"",
        webhook_secret: str = "",
        webhook_url: str = "",
        token_ttl: float = 3600.0,
        seed: int = 0,
        port: int = 0,
        offline_after: float = 30.0,
        lost_after: float = 600.0,
        time_scale: float = 1.0,
    ) -> None:
        self.app_id = app_id
        self.time_scale = time_scale
        self.public_key = public_key.encode() if isinstance(public_key, str) else public_key
        self.webhook_secret = webhook_secret
        self.token_ttl = token_ttl
        self.offline_after = offline_after
        self.lost_after = lost_after
        super().__init__(webhook_url=webhook_url, seed=seed, port=port)
        self.reset()

    # ---- lifecycle ----------------------------------------------------------------------------

    def reset(self) -> None:
        with self.lock:
            self.installations: dict[int, dict[str, Any]] = {}
            self.runner_groups: dict[int, dict[str, Any]] = {}
            self.tokens: dict[str, tuple[int, float]] = {}
            self.runs: dict[int, dict[str, Any]] = {}
            self.jobs: dict[int, Job] = {}
            self.runners: dict[int, Runner] = {}
            self.deliveries: list[Delivery] = []
            self.calls: list[tuple[str, str, int]] = []
            self.outbox: deque[tuple[Delivery, bool]] = deque()
            self.held_back: list[tuple[Delivery, float]] = []
            self.runner_faults: deque[str] = deque()
            self.error_rate = 0.0
            self.latency = 0.0
            self.drop_rate = 0.0  # failed deliveries (listed, redeliverable)
            self.lost_rate = 0.0  # never sent nor listed (only polling finds them)
            self.duplicate_rate = 0.0
            self.reorder_rate = 0.0
            self.rate_limited_until = 0.0
            self.rate_limit_secondary = False
            self.limits = dict(LIMITS)
            self.secondary_rate = 0.0
            self.secondary_styles: deque[str] = deque(SECONDARY_STYLES)
            self._primary: dict[int, tuple[float, int]] = {}  # installation -> (window start, used)
            self._windows: dict[str, tuple[float, int]] = {}  # limit key -> (window start, used)
            self._waits: dict[str, float] = {}  # endpoint -> no call before (a secondary answer's wait)
            self.limit_answers: list[tuple[float, str, int, str]] = []  # (when, endpoint, status, style)
            self.limit_violations: list[tuple[str, float]] = []  # (endpoint, seconds too early)
            self.creations = 0  # content-creating calls answered
            self._fail_next: list[tuple[re.Pattern[str], int, int]] = []
            self.runner_online_at: dict[int, float] = {}  # runner id -> its session (names repeat)
            self.jit_issued_at: dict[str, float] = {}  # runner name -> generate-jitconfig
            self.jit_issued: list[float] = []  # when each just-in-time configuration was issued
            self.issued_configs: list[str] = []  # every encoded config (tests: never in a log)
            self.max_runners_seen = 0
            self._ids = itertools.count(1000)

    # ---- controls (tests, the bench, ``make dev``) ---------------------------------------------

    def add_installation(
        self,
        installation_id: int,
        account: str,
        repositories: Iterable[str],
        *,
        account_type: str = "Organization",
        public: Iterable[str] = (),
    ) -> None:
        """An installation on ``account`` (an ``Organization``, or a ``User``: no organization
        runners there), seeing ``repositories``, of which ``public`` are public."""
        with self.lock:
            self.installations[installation_id] = {
                "account": account,
                "account_type": account_type,
                "repositories": list(repositories),
                "public": set(public),
            }
            # the Default group: private repositories only (allows_public_repositories false)
            self.runner_groups.setdefault(1, {"name": "Default", "allows_public_repositories": False})

    def queue_job(
        self,
        repository: str,
        labels: list[str],
        steps: list[str] | None = None,
        *,
        workflow: str = "CI",
        name: str = "build",
        installation_id: int | None = None,
        container: str | None = None,
        services: dict[str, str] | None = None,
    ) -> int:
        """A workflow run with one queued job (its ``workflow_job.queued`` delivery is sent)."""
        with self.lock:
            inst = installation_id or next(
                i for i, v in self.installations.items() if repository in v["repositories"]
            )
            run_id = next(self._ids)
            job = Job(
                id=next(self._ids),
                run_id=run_id,
                run_attempt=1,
                repository=repository,
                installation_id=inst,
                workflow=workflow,
                name=name,
                labels=list(labels),
                steps=list(steps or ["echo hello from $(uname -n)"]),
                container=container,
                services=dict(services or {}),
            )
            self.runs[run_id] = {"id": run_id, "name": workflow, "repository": repository, "run_attempt": 1}
            self.jobs[job.id] = job
            self._webhook(job, "queued")
            self.changed.notify_all()
            return job.id

    def cancel_job(self, job_id: int) -> None:
        """Cancel a job: a queued one completes ``cancelled`` at once; a running one when its
        runner next looks (or at once here, as GitHub ends it)."""
        with self.lock:
            job = self.jobs[job_id]
            if job.status == "completed":
                return
            runner = self.runners.get(job.runner_id) if job.runner_id else None
            self._complete(job, "cancelled")
            if runner is not None:
                runner.job_id = None
                self.runners.pop(runner.id, None)

    def rate_limit_for(self, seconds: float, *, secondary: bool = False) -> None:
        """Every REST call answers 403 rate limited for ``seconds``."""
        with self.lock:
            self.rate_limited_until = time.time() + seconds
            self.rate_limit_secondary = secondary

    def api_calls(self) -> int:
        """REST calls Catacloud made (the runner protocol and the controls not counted)."""
        with self.lock:
            return sum(1 for _, r, _ in self.calls if not r.startswith("/_"))

    def summary(self) -> dict[str, Any]:
        with self.lock:
            now = time.time()
            return {
                "jobs": {
                    s: sum(1 for j in self.jobs.values() if j.status == s)
                    for s in ("queued", "in_progress", "completed")
                },
                "runners": [r.as_json(now, self.offline_after) for r in self.runners.values()],
                "deliveries": len(self.deliveries),
                "api_calls": sum(1 for _, r, _ in self.calls if not r.startswith("/_")),
            }

    # ---- webhooks -------------------------------------------------------------------------------

    def _webhook(self, job: Job, action: str) -> None:
        """Queue a ``workflow_job`` delivery (the lock is held)."""
        inst = self.installations.get(job.installation_id, {})
        payload: dict[str, Any] = {
            "action": action,
            "workflow_job": job.as_json(),
            "repository": self._repository_json(inst, job.repository),
            "installation": {"id": job.installation_id},
            "sender": {"login": "octocat"},
        }
        if inst.get("account_type", "Organization") == "Organization":  # a user's repository names none
            payload["organization"] = {"login": inst.get("account", job.repository.split("/")[0])}
        delivery = Delivery(
            next(self._ids),
            str(uuid.uuid4()),
            "workflow_job",
            action,
            job.installation_id,
            json.dumps(payload).encode(),
        )
        roll = self.rng.random()
        if roll < self.lost_rate:
            return  # lost on GitHub's side: never sent, never listed
        self.deliveries.append(delivery)
        if roll < self.lost_rate + self.drop_rate:
            delivery.status_code = 502  # failed: listed, redeliverable
            return
        self.outbox.append((delivery, False))
        if self.rng.random() < self.duplicate_rate:
            self.outbox.append((delivery, True))
        self.changed.notify_all()

    @staticmethod
    def _repository_json(inst: dict[str, Any], full_name: str) -> dict[str, Any]:
        public = full_name in inst.get("public", ())
        return {
            "id": abs(hash(full_name)) % 10**8,
            "full_name": full_name,
            "name": full_name.split("/")[1],
            "owner": {"login": full_name.split("/")[0], "type": inst.get("account_type", "Organization")},
            "private": not public,
            "visibility": "public" if public else "private",
        }

    def _may_reorder(self, delivery: Delivery) -> bool:
        return not delivery.redelivery

    def _delivery_headers(self, delivery: Delivery) -> dict[str, str]:
        return {
            "User-Agent": "GitHub-Hookshot/fake",
            "X-GitHub-Event": delivery.event,
            "X-GitHub-Delivery": delivery.guid,
            "X-GitHub-Hook-ID": "1",
            "X-GitHub-Hook-Installation-Target-ID": str(self.app_id),
            "X-GitHub-Hook-Installation-Target-Type": "integration",
            "X-Hub-Signature-256": sign(self.webhook_secret, delivery.body),
        }

    def delivery_for(self, job_id: int, action: str) -> Delivery | None:
        """The first delivery of ``job_id``'s ``action`` (the bench times them)."""
        with self.lock:
            for delivery in self.deliveries:
                if delivery.action == action and json.loads(delivery.body)["workflow_job"]["id"] == job_id:
                    return delivery
        return None

    def redeliver(self, delivery_id: int) -> None:
        with self.lock:
            original = next(d for d in self.deliveries if d.id == delivery_id)
            again = Delivery(
                next(self._ids),
                original.guid,
                original.event,
                original.action,
                original.installation_id,
                original.body,
                redelivery=True,
            )
            self.deliveries.append(again)
            self.outbox.append((again, False))
            self.changed.notify_all()

    # ---- runners: the sweeper --------------------------------------------------------------------

    def sweep(self) -> None:
        with self.lock:
            now = time.time()
            for runner in list(self.runners.values()):
                if runner.job_id is not None and runner.session and now - runner.last_seen > self.lost_after:
                    job = self.jobs.get(runner.job_id)
                    runner.job_id = None
                    self.runners.pop(runner.id, None)
                    if job is not None and job.status != "completed":
                        self._complete(job, "failure")  # the runner lost communication

    def _complete(self, job: Job, conclusion: str) -> None:
        job.status, job.conclusion, job.completed_at = "completed", conclusion, time.time()
        self._webhook(job, "completed")

    def _take(self, runner: Runner) -> Job | None:
        """The oldest queued job this runner may run: all its labels are the runner's, and its
        repository is the runner's (or in the runner's organization)."""
        mine = {label.lower() for label in runner.labels}
        for job in sorted(self.jobs.values(), key=lambda j: j.id):
            if job.status != "queued" or job.installation_id != runner.installation_id:
                continue
            if not {label.lower() for label in job.labels} <= mine:
                continue
            kind, _, owner = runner.owner.partition(":")
            if kind == "repo" and job.repository != owner:
                continue
            if kind == "org" and job.repository.split("/")[0] != owner:
                continue
            group = self.runner_groups.get(runner.group, {})
            public = job.repository in self.installations.get(job.installation_id, {}).get("public", ())
            if kind == "org" and public and not group.get("allows_public_repositories"):
                continue  # the group serves private repositories only
            job.status, job.started_at = "in_progress", time.time()
            job.runner_id, job.runner_name = runner.id, runner.name
            runner.job_id = job.id
            self._webhook(job, "in_progress")
            return job
        return None

    # ---- HTTP --------------------------------------------------------------------------------------

    def _route(
        self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, Any], raw: bytes
    ) -> tuple[int, Any, dict[str, str]]:
        if path.startswith("/_runner/"):
            status, body = self._runner_api(handler, path, query, raw)
            return status, body, {}
        return self._rest(handler, path, query, raw)

    def _queue_from(self, body: dict[str, Any]) -> int:
        return self.queue_job(
            body["repository"],
            list(body.get("labels") or ["self-hosted"]),
            list(body.get("steps") or []) or None,
            workflow=str(body.get("workflow", "CI")),
            name=str(body.get("name", "build")),
            container=body.get("container"),
            services=body.get("services"),
        )

    def _job_json(self, job: Job) -> dict[str, Any]:
        return job.as_json()

    def _rate_limit_from(self, body: dict[str, Any]) -> None:
        self.rate_limit_for(float(body["rate_limit_seconds"]), secondary=bool(body.get("secondary")))

    # ---- GitHub's limits (the module docstring says where each comes from) --------------------

    def _seconds(self, documented: float) -> float:
        """A documented window or wait on the fake's clock (``time_scale`` times shorter)."""
        return documented / self.time_scale

    def _window(self, key: str, seconds: float, now: float) -> tuple[float, int]:
        start, used = self._windows.get(key, (now, 0))
        if now - start >= self._seconds(seconds):
            start, used = now, 0
        return start, used

    def primary_limit(self, inst_id: int) -> int:
        repos = len(self.installations.get(inst_id, {}).get("repositories", []))
        per_hour, per_repo, most = (self.limits[k] for k in ("primary", "primary_per_repo", "primary_max"))
        return min(most, per_hour + per_repo * max(0, repos - 20))

    def _rate_headers(self, inst_id: int, *, count: bool = True) -> dict[str, str]:
        """The installation's primary limit: its headers, or 403 with none remaining."""
        now = time.time()
        with self.lock:
            start, used = self._primary.get(inst_id, (now, 0))
            if now - start >= self._seconds(3600):
                start, used = now, 0
            limit = self.primary_limit(inst_id)
            if count and used >= limit:
                raise HttpError(
                    403,
                    f"API rate limit exceeded for installation ID {inst_id}.",
                    self._primary_headers(limit, limit, start),
                )
            if count:
                used += 1
                self._primary[inst_id] = (start, used)
        return self._primary_headers(limit, used, start)

    def _primary_headers(self, limit: int, used: int, start: float) -> dict[str, str]:
        return {
            "x-ratelimit-limit": str(limit),
            "x-ratelimit-remaining": str(max(0, limit - used)),
            "x-ratelimit-used": str(used),
            "x-ratelimit-reset": str(int(start + self._seconds(3600)) + 1),
            "x-ratelimit-resource": "core",
        }

    def _secondary(self, method: str, path: str, headers: dict[str, str]) -> None:
        """Points per endpoint, content creation, and any secondary answer still to wait for."""
        endpoint = endpoint_of(method, path)
        now = time.time()
        with self.lock:
            due = self._waits.get(endpoint, 0.0)
            if now < due:
                self.limit_violations.append((endpoint, due - now))
                raise self._secondary_answer(endpoint, headers, due - now, now, again=True)
            points = 1 if method in ("GET", "HEAD", "OPTIONS") else 5
            counted = [(f"points {endpoint}", 60.0, points, self.limits["endpoint_points_per_minute"])]
            if CREATING.fullmatch(f"{method} {path}"):
                counted += [
                    ("creations per minute", 60.0, 1, self.limits["creations_per_minute"]),
                    ("creations per hour", 3600.0, 1, self.limits["creations_per_hour"]),
                ]
            for key, seconds, cost, most in counted:
                start, used = self._window(key, seconds, now)
                if used + cost > most:
                    raise self._secondary_answer(endpoint, headers, start + self._seconds(seconds) - now, now)
            if self.secondary_rate and self.rng.random() < self.secondary_rate:
                raise self._secondary_answer(endpoint, headers, self._seconds(SECONDARY_WAIT), now)
            for key, seconds, cost, _ in counted:
                start, used = self._window(key, seconds, now)
                self._windows[key] = (start, used + cost)
            self.creations += len(counted) > 1

    def _secondary_answer(
        self, endpoint: str, headers: dict[str, str], left: float, now: float, *, again: bool = False
    ) -> HttpError:
        """A secondary-limit answer in the next of ``secondary_styles``; the endpoint may be called
        again after its ``retry-after``, or the documented minute when there is none."""
        style = self.secondary_styles[0]
        self.secondary_styles.rotate(-1)
        status = 429 if style == "bare_429" else 403
        extra = {**headers}
        wait = self._seconds(SECONDARY_WAIT)
        if style == "retry_after":
            wait = max(1.0, float(int(left) + 1))
            extra["retry-after"] = str(int(wait))
        if not again:
            self._waits[endpoint] = max(self._waits.get(endpoint, 0.0), now + wait)
        self.limit_answers.append((now, endpoint, status, style))
        return HttpError(status, SECONDARY_MESSAGE, extra)

    def _rest(
        self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, Any, dict[str, str]]:
        method = handler.command
        if self.latency:
            time.sleep(self.latency)
        auth = handler.headers.get("Authorization", "")
        now = time.time()
        if now < self.rate_limited_until:
            if self.rate_limit_secondary:
                raise HttpError(
                    403,
                    SECONDARY_MESSAGE,
                    {"retry-after": str(int(self.rate_limited_until - now) + 1)},
                )
            raise HttpError(
                403,
                "API rate limit exceeded",
                {
                    "x-ratelimit-limit": str(self.limits["primary"]),
                    "x-ratelimit-remaining": "0",
                    "x-ratelimit-reset": str(int(self.rate_limited_until) + 1),
                },
            )
        if not path.startswith("/app"):
            primary = self._rate_headers(self._check_token(auth), count=False)
            self._secondary(method, path, primary)
        else:
            self._secondary(method, path, {})
        self._inject_faults(method, path)
        body = json.loads(raw) if raw else {}
        if path.startswith("/app"):
            self._check_jwt(auth)
            headers: dict[str, str] = {}
            if m := re.fullmatch(r"/app/installations/(\d+)/access_tokens", path):
                if method != "POST":
                    raise HttpError(404, "Not Found")
                inst = int(m.group(1))
                if inst not in self.installations:
                    raise HttpError(404, "Not Found")
                token = "ghs_" + secrets.token_urlsafe(24)
                expires = now + self.token_ttl
                with self.lock:
                    self.tokens[token] = (inst, expires)
                return (
                    201,
                    {"token": token, "expires_at": iso(expires), "permissions": {"administration": "write"}},
                    headers,
                )
            if path == "/app/hook/deliveries" and method == "GET":
                return self._deliveries_page(query)
            if (m := re.fullmatch(r"/app/hook/deliveries/(\d+)/attempts", path)) and method == "POST":
                try:
                    self.redeliver(int(m.group(1)))
                except StopIteration:
                    raise HttpError(404, "Not Found") from None
                return 202, {}, headers
            raise HttpError(404, "Not Found")
        inst_id = self._check_token(auth)
        headers = self._rate_headers(inst_id)
        installation = self.installations[inst_id]
        with self.lock:
            if path == "/installation/repositories" and method == "GET":
                repos = [self._repository_json(installation, r) for r in installation["repositories"]]
                return 200, self._page(query, "repositories", repos), headers
            if m := re.fullmatch(r"/(orgs/([^/]+)|repos/([^/]+/[^/]+))/actions/runners(/.*)?", path):
                owner = f"org:{m.group(2)}" if m.group(2) else f"repo:{m.group(3)}"
                if m.group(2) and (
                    m.group(2) != installation["account"] or installation["account_type"] == "User"
                ):
                    raise HttpError(404, "Not Found")  # a user account has no /orgs/{login}
                if m.group(3) and m.group(3) not in installation["repositories"]:
                    raise HttpError(404, "Not Found")
                return (*self._runners_api(method, owner, inst_id, m.group(4) or "", query, body), headers)
            if m := re.fullmatch(r"/repos/([^/]+/[^/]+)/actions/(runs|jobs)(/.*)?", path):
                repo = m.group(1)
                if repo not in installation["repositories"]:
                    raise HttpError(404, "Not Found")
                return (*self._runs_api(method, repo, m.group(2), m.group(3) or "", query), headers)
        raise HttpError(404, "Not Found")

    def _deliveries_page(self, query: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        """Newest first, ``per_page`` (at most 100) at a time; the next page's ``cursor`` (the
        last one's id here) in the ``Link`` header, as GitHub pages its deliveries."""
        per_page = max(1, min(100, int(query.get("per_page", 30))))
        cursor = int(query["cursor"]) if query.get("cursor", "").isdigit() else None
        with self.lock:
            items = sorted(self.deliveries, key=lambda d: -d.id)
            if cursor is not None:
                items = [d for d in items if d.id < cursor]
            page = [d.as_json() for d in items[:per_page]]
        headers = {}
        if len(items) > per_page:
            after = f"{self._base()}/app/hook/deliveries?per_page={per_page}&cursor={page[-1]['id']}"
            headers["Link"] = f'<{after}>; rel="next"'
        return 200, page, headers

    def _base(self) -> str:
        return self.url if self._server is not None else "http://github.invalid"

    def _check_jwt(self, auth: str) -> None:
        if not auth.startswith("Bearer "):
            raise HttpError(401, "A JSON web token could not be decoded")
        try:
            claims = jwt.decode(
                auth[7:],
                self.public_key,
                algorithms=["RS256"],
                # its times are checked below against the fake's own clock (time.time: a
                # simulated one in a simulation), not PyJWT's datetime.now
                options={"require": ["iat", "exp", "iss"], "verify_exp": False, "verify_iat": False},
            )
        except jwt.PyJWTError as exc:
            raise HttpError(401, f"A JSON web token could not be decoded ({type(exc).__name__})") from None
        if str(claims["iss"]) != str(self.app_id):
            raise HttpError(401, "Integration not found")
        now = time.time()
        if not isinstance(claims["exp"], int | float) or claims["exp"] < now - 5:
            raise HttpError(
                401,
                "'Expiration time' claim ('exp') must be a numeric value representing the future "
                "time at which the assertion expires",
            )
        if not isinstance(claims["iat"], int | float) or claims["iat"] > now + 5:
            raise HttpError(
                401,
                "'Issued at' claim ('iat') must be an Integer representing the time that the assertion "
                "was issued",
            )
        if claims["exp"] - claims["iat"] > 600:
            raise HttpError(401, "'Expiration time' claim ('exp') is too far in the future")

    def _check_token(self, auth: str) -> int:
        token = auth.removeprefix("Bearer ").removeprefix("token ")
        with self.lock:
            found = self.tokens.get(token)
        if found is None or found[1] < time.time():
            raise HttpError(401, "Bad credentials")
        return found[0]

    @staticmethod
    def _page(query: dict[str, str], key: str, items: list[Any]) -> dict[str, Any]:
        per_page = max(1, min(100, int(query.get("per_page", 30))))
        page = max(1, int(query.get("page", 1)))
        return {"total_count": len(items), key: items[(page - 1) * per_page : page * per_page]}

    def _runners_api(
        self, method: str, owner: str, inst_id: int, rest: str, query: dict[str, str], body: dict[str, Any]
    ) -> tuple[int, Any]:
        now = time.time()
        mine = [r for r in self.runners.values() if r.owner == owner]
        if rest == "" and method == "GET":
            if "name" in query:
                mine = [r for r in mine if r.name == query["name"]]
            return 200, self._page(
                query,
                "runners",
                [r.as_json(now, self.offline_after) for r in sorted(mine, key=lambda r: r.id)],
            )
        if rest == "/generate-jitconfig" and method == "POST":
            name, labels, group = body.get("name"), body.get("labels"), body.get("runner_group_id")
            if group is None:
                raise HttpError(422, "Invalid request: object is missing required key: runner_group_id")
            if not isinstance(labels, list) or not 1 <= len(labels) <= 100:
                raise HttpError(422, "Invalid request: labels must have between 1 and 100 items")
            if not isinstance(name, str) or not name:
                raise HttpError(422, "Invalid request: name is required")
            if any(r.name == name for r in mine):
                # GitHub's REST docs, "Create configuration for a just-in-time runner for an
                # organization" (and "... for a repository"): status codes 201, 404, 409 Conflict,
                # 422; a name already registered where the runner would go is the 409 (what
                # actions/runner's config.sh reports as "A runner exists with the same name").
                raise HttpError(409, "Already exists - A runner with the name already exists.")
            fault = self.runner_faults.popleft() if self.runner_faults else None
            runner = Runner(
                next(self._ids),
                name,
                [str(x) for x in labels],
                int(group),
                inst_id,
                owner,
                secrets.token_urlsafe(24),
                fault,
            )
            self.runners[runner.id] = runner
            self.jit_issued_at[name] = now
            self.jit_issued.append(now)
            self.max_runners_seen = max(self.max_runners_seen, len(self.runners))
            config = {
                "url": self.url,
                "runner_id": runner.id,
                "name": name,
                "secret": runner.secret,
                "fault": fault,
            }
            encoded = base64.b64encode(json.dumps(config).encode()).decode()
            self.issued_configs.append(encoded)
            return 201, {"runner": runner.as_json(now, self.offline_after), "encoded_jit_config": encoded}
        if m := re.fullmatch(r"/(\d+)", rest):
            found = next((r for r in mine if r.id == int(m.group(1))), None)
            if found is None:
                raise HttpError(404, "Not Found")
            runner = found
            if method == "GET":
                return 200, runner.as_json(now, self.offline_after)
            if method == "DELETE":
                if runner.job_id is not None:
                    raise HttpError(422, f'Bad request - Runner "{runner.name}" is still running a job"')
                self.runners.pop(runner.id, None)
                self.changed.notify_all()
                return 204, None
        raise HttpError(404, "Not Found")

    def _runs_api(
        self, method: str, repo: str, kind: str, rest: str, query: dict[str, str]
    ) -> tuple[int, Any]:
        jobs = [j for j in self.jobs.values() if j.repository == repo]
        if kind == "jobs":
            m = re.fullmatch(r"/(\d+)", rest)
            job = self.jobs.get(int(m.group(1))) if m else None
            if job is None or job.repository != repo or method != "GET":
                raise HttpError(404, "Not Found")
            return 200, job.as_json()
        if rest == "" and method == "GET":
            runs = []
            for run in sorted(self.runs.values(), key=lambda r: -r["id"]):
                if run["repository"] != repo:
                    continue
                states = {j.status for j in jobs if j.run_id == run["id"]}
                status = (
                    "completed"
                    if states == {"completed"}
                    else ("queued" if states <= {"queued"} else "in_progress")
                )
                if query.get("status") in (None, status):
                    runs.append(
                        {
                            "id": run["id"],
                            "name": run["name"],
                            "status": status,
                            "run_attempt": run["run_attempt"],
                        }
                    )
            return 200, self._page(query, "workflow_runs", runs)
        if (m := re.fullmatch(r"/(\d+)/jobs", rest)) and method == "GET":
            of_run = [j.as_json() for j in sorted(jobs, key=lambda j: j.id) if j.run_id == int(m.group(1))]
            return 200, self._page(query, "jobs", of_run)
        if (m := re.fullmatch(r"/(\d+)/cancel", rest)) and method == "POST":
            for job in jobs:
                if job.run_id == int(m.group(1)):
                    self.cancel_job(job.id)
            return 202, {}
        raise HttpError(404, "Not Found")

    # ---- the runner side (the stand-in runner's protocol) ------------------------------------------

    def _runner_api(
        self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, Any]:
        m = re.fullmatch(r"/_runner/(\d+)/(session|job|jobs/(\d+)/complete)", path)
        if m is None:
            raise HttpError(404, "Not Found")
        with self.changed:
            runner = self.runners.get(int(m.group(1)))
            if runner is None or handler.headers.get("Authorization") != f"RunnerSecret {runner.secret}":
                raise HttpError(404, "runner not registered (removed)")
            runner.last_seen = time.time()
            if m.group(2) == "session":
                if runner.fault == "deprecated":
                    # GitHub's broker refuses a listener too old (actions/runner
                    # src/Sdk/WebApi/WebApi/BrokerHttpClient.cs: RunnerVersionTooOld ->
                    # AccessDeniedException with ErrorCode 1)
                    return 403, {"errorKind": "RunnerVersionTooOld", "message": DEPRECATED_MESSAGE}
                runner.session = True
                if runner.online_at is None:
                    runner.online_at = runner.last_seen
                    self.runner_online_at[runner.id] = runner.last_seen
                return 200, {"runner_id": runner.id, "name": runner.name}
            if m.group(2) == "job":
                deadline = time.time() + min(30.0, float(query.get("wait", 20)))
                while True:
                    if runner.id not in self.runners:
                        raise HttpError(404, "runner removed")
                    job = self._take(runner) if runner.job_id is None else None
                    if job is not None:
                        return 200, {
                            "job": {
                                "id": job.id,
                                "name": job.name,
                                "repository": job.repository,
                                "steps": job.steps,
                                # the workflow's job container and service containers (the
                                # real runner gets mappings in its job message, JobContainer and
                                # JobServiceContainers: image, options, env, ports, ...; only
                                # the image here)
                                "container": job.container,
                                "services": job.services,
                            }
                        }
                    remaining = deadline - time.time()
                    if remaining <= 0 or self._stop.is_set():
                        runner.last_seen = time.time()
                        return 204, None
                    self.changed.wait(min(remaining, 1.0))
                    runner.last_seen = time.time()
            job = self.jobs.get(int(m.group(3)))
            if job is None or runner.job_id != job.id:
                return 409, {"message": "not this runner's job"}
            conclusion = (json.loads(raw) if raw else {}).get("conclusion", "success")
            runner.job_id = None
            self.runners.pop(runner.id, None)  # just-in-time: one job, then removed
            if job.status != "completed":
                self._complete(job, str(conclusion))
            return 200, {"ok": True}

    # ---- controls over HTTP (make dev, another process) --------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Serve the fake until interrupted (``make dev`` runs it this way when asked to)."""
    parser = argparse.ArgumentParser(prog="python -m testkit.github_fake", description=__doc__)
    parser.add_argument("--port", type=int, default=8070)
    parser.add_argument("--app-id", type=int, default=1)
    parser.add_argument("--public-key-file", required=True, help="the App's public (or private) key, PEM")
    parser.add_argument("--webhook-secret-file", required=True)
    parser.add_argument("--webhook-url", required=True)
    parser.add_argument("--installation", type=int, default=1, help="installation id")
    parser.add_argument("--account", default="demo-org")
    parser.add_argument("--repository", action="append", default=[], help="owner/name (repeatable)")
    args = parser.parse_args(argv)
    from pathlib import Path

    from cryptography.hazmat.primitives import serialization

    pem = Path(args.public_key_file).read_bytes()
    if b"PRIVATE" in pem:
        key = serialization.load_pem_private_key(pem, password=None)
        pem = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    fake = FakeGitHub(
        app_id=args.app_id,
        public_key=pem,
        webhook_secret=Path(args.webhook_secret_file).read_text().strip(),
        webhook_url=args.webhook_url,
        port=args.port,
    )
    fake.add_installation(args.installation, args.account, args.repository or [f"{args.account}/app"])
    fake.start()
    print(f"fake GitHub at {fake.url} (controls: POST {fake.url}/_fake/jobs)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
