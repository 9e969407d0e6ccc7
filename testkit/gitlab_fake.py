"""A stateful fake of GitLab for GitLab CI on Catacloud: the REST API v4 endpoints Catacloud
calls, a Job event sender, and the runner API a stand-in ``gitlab-runner``
(``testkit/gitlab_runner``) talks to. Standard library only, so ``make dev`` can run it as a
process (``python -m testkit.gitlab_fake``) and tests in a thread::

    fake = FakeGitLab(token="glpat-…", webhook_token="s3cret", webhook_url=url).start()
    fake.add_project(12, "acme/app")
    job_id = fake.queue_job("acme/app", ["catacloud", "linux-2cpu"], ["echo hi"])
    ...
    fake.stop()

REST (``fake.url`` is GitLab's URL; the API is under ``/api/v4``, authenticated by
``PRIVATE-TOKEN``): ``POST /user/runners`` (project or group runner; 400 on a maximum_timeout
under 600 s, 403 for an instance runner, 404 for a project or group it does not know), ``GET
/runners``, ``GET|PUT|DELETE /runners/:id``, ``GET /runners/:id/jobs``, ``GET
/projects/:id/jobs`` (``scope[]``), ``GET /projects/:id/jobs/:job_id``, ``POST
/projects/:id/jobs/:job_id/cancel``. Every answer carries ``RateLimit-*``; faults: a 5xx rate,
``fail_next``, latency, a rate-limit window (429 with ``Retry-After``).

Job events (``X-Gitlab-Event: Job Hook``, ``X-Gitlab-Token``, ``Idempotency-Key``): created,
pending, running, success / failed / canceled, shaped like GitLab's: no job tags (gitlabhq
``lib/gitlab/data_builder/build.rb`` builds the event with the runner's ``tags`` only; GitLab
issue 467657 asks for the job's), with injectable drops (never sent:
GitLab does not retry), duplicates (the same key again) and reordering.

Runners: ``POST /user/runners`` answers a ``glrt-`` token; a runner (``run-single`` asks for
jobs at once, never ``/api/v4/runners/verify``: gitlab-runner ``commands/single.go``) long-polls
``/api/v4/jobs/request`` with its ``system_id`` (its runner manager) and is handed the oldest
pending job whose tags it has (ANY such job, as GitLab does; never an untagged one: runners are
created with ``run_untagged: false``), keeps the job alive with trace updates and reports its
end (``PUT /api/v4/jobs/:id``). It stays registered until it is deleted. ``runner_faults`` makes
the next runners crash, hang or never connect. A running job not updated (trace or state) for
``lost_after`` seconds fails (``stuck_or_timeout_failure``); a runner not heard from for
``offline_after`` reads offline.

What GitLab does with a runner's token, as its source says (gitlabhq ``lib/api/ci/runner.rb``,
``lib/api/ci/helpers/runner.rb``), and so does this fake:

- ``POST /jobs/request`` hands a job to ANY request that carries the token of a runner that is
  registered and not paused, however many jobs that runner already runs: GitLab keeps no count
  per runner (``gitlab-runner``'s ``concurrent``/``limit`` and ``run-single --max-builds`` are
  the runner's own). Whoever holds the token can take jobs.
- A paused runner (``PUT /runners/:id`` ``paused: true``) is answered 204, no job
  (``unless current_runner.active? ... no_content!``), but its token stays valid.
- A deleted runner's token is answered 403 (``authenticate_runner!``: ``forbidden! unless
  current_runner``), on ``/jobs/request`` and ``/runners/verify`` alike.
- A job's own calls (``PUT /jobs/:id``, ``PATCH /jobs/:id/trace``) are authenticated by the
  job's token alone (``authenticate_job!``: ``job.runner&.heartbeat``, the runner may be gone);
  deleting a runner does not touch its running job (``config/gitlab_loose_foreign_keys.yml``:
  ``p_ci_builds.runner_id`` is ``async_nullify``), which runs to its end, its ``runner``
  reading null from then on.
- Only a running job that nobody updates is failed, after an hour
  (``app/services/ci/stuck_builds/drop_running_service.rb``: ``lost_after`` here).
"""

from __future__ import annotations

import argparse
import contextlib
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
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any

from testkit.forge_fake import FakeForge, HttpError, clock, iso

DONE = ("success", "failed", "canceled", "skipped")


def _runner_side(path: str) -> bool:
    """A call of the runner API (a runner's token), not of the REST API (the access token)."""
    return path in ("/api/v4/runners/verify", "/api/v4/jobs/request") or bool(
        re.fullmatch(r"/api/v4/jobs/\d+(/trace)?", path)
    )


def _event_time(ts: float | None) -> str | None:
    """The Job event's own format: ``2021-01-13 17:57:05 UTC``."""
    return None if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass
class Project:
    id: int
    path: str
    group_id: int | None = None


@dataclass
class Job:
    id: int
    project_id: int
    project: str
    pipeline_id: int
    pipeline: str  # the pipeline's name (workflow:name)
    ref: str
    name: str
    stage: str
    tags: list[str]
    script: list[str]
    image: str | None = None  # the job's ``image:`` (.gitlab-ci.yml), for a docker executor
    services: list[dict[str, Any]] = field(default_factory=list)  # its ``services:`` (name, command)
    status: str = "created"
    failure_reason: str | None = None
    runner_id: int | None = None
    system_id: str | None = None  # the runner manager that took it
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))  # the job's CI_JOB_TOKEN
    created_at: float = field(default_factory=clock)
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float | None = None  # its last trace or state update (a running job's liveness)

    def as_json(self, runners: dict[int, Runner]) -> dict[str, Any]:
        runner = runners.get(self.runner_id) if self.runner_id else None  # deleted: null
        return {
            "id": self.id,
            "status": self.status,
            "stage": self.stage,
            "name": self.name,
            "ref": self.ref,
            "tag": False,
            "tag_list": list(self.tags),
            "allow_failure": False,
            "created_at": iso(self.created_at),
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "failure_reason": self.failure_reason,
            "pipeline": {"id": self.pipeline_id, "project_id": self.project_id, "ref": self.ref},
            "runner": runner.brief() if runner else None,
            # the jobs API names the runner manager (APIEntitiesCiJob ``runner_manager``)
            "runner_manager": {"system_id": self.system_id} if runner and self.system_id else None,
            "web_url": f"/{self.project}/-/jobs/{self.id}",
        }


@dataclass
class Runner:
    id: int
    token: str
    description: str
    tags: list[str]
    run_untagged: bool
    runner_type: str
    project_id: int | None
    group_id: int | None
    maximum_timeout: int
    fault: str | None
    paused: bool = False
    contacted_at: float | None = None
    job_id: int | None = None
    # Its runner managers (GitLab 16+: each gitlab-runner process with its own system_id that
    # asks for jobs with the runner's token): system_id -> last contact.
    managers: dict[str, float] = field(default_factory=dict)
    created_at: float = field(default_factory=clock)

    def status(self, now: float, offline_after: float) -> str:
        if self.contacted_at is None:
            return "never_contacted"
        return "online" if now - self.contacted_at < offline_after else "offline"

    def brief(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "description": self.description,
            "runner_type": self.runner_type,
            "active": not self.paused,
            "is_shared": False,
            "tags": list(self.tags),
        }

    def as_json(self, now: float, offline_after: float) -> dict[str, Any]:
        status = self.status(now, offline_after)
        return {
            **self.brief(),
            "paused": self.paused,
            "name": "gitlab-runner",
            "online": status == "online",
            "status": status,
            "ip_address": "127.0.0.1",
            "tag_list": list(self.tags),
            "run_untagged": self.run_untagged,
            "maximum_timeout": self.maximum_timeout,
            "contacted_at": iso(self.contacted_at),
        }


@dataclass
class Delivery:
    id: int
    key: str
    job_id: int
    status: str
    body: bytes
    status_code: int = 0
    delivered_at: float = field(default_factory=clock)
    duration: float = 0.0


class FakeGitLab(FakeForge):
    """The fake. Thread-safe; ``calls`` records ``(method, route, status)`` of every REST call
    (``runner_calls`` those of the runner API)."""

    name = "gitlab"
    not_found = "404 Not Found"

    def __init__(
        self,
        *,
        token: str = "",
        webhook_token: str = "",
        webhook_url: str = "",
        seed: int = 0,
        port: int = 0,
        offline_after: float = 30.0,
        lost_after: float = 60.0,
    ) -> None:
        self.token = token
        self.webhook_token = webhook_token
        self.offline_after = offline_after
        self.lost_after = lost_after
        super().__init__(webhook_url=webhook_url, seed=seed, port=port)
        self.reset()

    # ---- lifecycle ----------------------------------------------------------------------------

    def reset(self) -> None:
        with self.lock:
            self.projects: dict[int, Project] = {}
            self.jobs: dict[int, Job] = {}
            self.runners: dict[int, Runner] = {}
            self.all_runners: dict[int, Runner] = {}  # deleted ones too (GitLab's cap counts them)
            self.deliveries: list[Delivery] = []
            self.calls: list[tuple[str, str, int]] = []
            self.runner_calls: list[tuple[str, str, int]] = []
            self.outbox: deque[tuple[Delivery, bool]] = deque()
            self.held_back: list[tuple[Delivery, float]] = []
            self.runner_faults: deque[str] = deque()
            self.error_rate = 0.0
            self.latency = 0.0
            self.lost_rate = 0.0  # events never sent (GitLab does not retry: only polling finds them)
            self.duplicate_rate = 0.0
            self.reorder_rate = 0.0
            # GitLab.com's runner cap: runners created or active in a project (group) in the past
            # seven days (Free 50, paid tiers 1,000: GitLab issue 342757; "created or active in
            # the past seven days": MR 175877); None: no cap (self-managed by default here).
            self.runner_cap: int | None = None
            self.cap_refusals = 0
            self.now = clock  # the fake's clock (time.time at each call: a simulation moves it)
            self.rate_limited_until = 0.0
            self.rate_limit = 2000
            self._rate_used = 0
            self._rate_window = time.time()
            self._fail_next: list[tuple[re.Pattern[str], int, int]] = []
            self.runner_online_at: dict[int, float] = {}  # runner id -> its first contact
            self.runner_created_at: dict[int, float] = {}
            self.runners_seen: dict[int, str] = {}  # runner id -> its description (deleted ones too)
            self.issued_tokens: list[str] = []  # every glrt- token (tests: never in a log)
            self.deleted_runners: list[int] = []
            self.max_runners_seen = 0
            self._ids = itertools.count(1000)

    # ---- controls (tests, the bench, ``make dev``) ---------------------------------------------

    def add_project(self, project_id: int, path: str, group_id: int | None = None) -> None:
        with self.lock:
            self.projects[project_id] = Project(project_id, path, group_id)

    def project_named(self, path: str) -> Project:
        with self.lock:
            return next(p for p in self.projects.values() if p.path == path)

    def queue_job(
        self,
        project: str,
        tags: Iterable[str],
        script: list[str] | None = None,
        *,
        pipeline: str = "CI",
        name: str = "build",
        stage: str = "test",
        ref: str = "main",
        image: str | None = None,
        services: Iterable[dict[str, Any]] = (),
    ) -> int:
        """A pipeline with one job: created, then pending (each with its Job event)."""
        with self.lock:
            where = self.project_named(project)
            job = Job(
                id=next(self._ids),
                project_id=where.id,
                project=where.path,
                pipeline_id=next(self._ids),
                pipeline=pipeline,
                ref=ref,
                name=name,
                stage=stage,
                tags=[str(t) for t in tags],
                script=list(script or ["echo hello from $(uname -n)"]),
                image=image,
                services=[dict(service) for service in services],
            )
            self.jobs[job.id] = job
            self._event(job)
            job.status = "pending"
            self._event(job)
            self.changed.notify_all()
            return job.id

    def cancel_job(self, job_id: int) -> None:
        """Cancel a job: a pending one ends ``canceled`` at once; a running one too (its runner's
        next trace update or report is refused, and it stops)."""
        with self.lock:
            job = self.jobs[job_id]
            if job.status in DONE:
                return
            runner = self.runners.get(job.runner_id) if job.runner_id else None
            if runner is not None and runner.job_id == job.id:
                runner.job_id = None
            self._finish(job, "canceled")

    def rate_limit_for(self, seconds: float) -> None:
        """Every REST call answers 429 (``Retry-After``) for ``seconds``."""
        with self.lock:
            self.rate_limited_until = time.time() + seconds

    def api_calls(self) -> int:
        """REST calls Catacloud made (the runner API and the controls not counted)."""
        with self.lock:
            return len(self.calls)

    def summary(self) -> dict[str, Any]:
        with self.lock:
            now = time.time()
            statuses: dict[str, int] = {}
            for job in self.jobs.values():
                statuses[job.status] = statuses.get(job.status, 0) + 1
            return {
                "jobs": statuses,
                "runners": [r.as_json(now, self.offline_after) for r in self.runners.values()],
                "deliveries": len(self.deliveries),
                "api_calls": len(self.calls),
            }

    def unfinished(self, ids: Iterable[int]) -> list[int]:
        with self.lock:
            return [i for i in ids if self.jobs[i].status not in DONE]

    # ---- Job events ----------------------------------------------------------------------------

    def _payload(self, job: Job) -> dict[str, Any]:
        runner = self.runners.get(job.runner_id) if job.runner_id else None
        duration = (job.finished_at or time.time()) - job.started_at if job.started_at else None
        payload: dict[str, Any] = {
            "object_kind": "build",
            "ref": job.ref,
            "tag": False,
            "before_sha": "0" * 40,
            "sha": "1" * 40,
            "retries_count": 0,
            "build_id": job.id,
            "build_name": job.name,
            "build_stage": job.stage,
            "build_status": job.status,
            "build_created_at": _event_time(job.created_at),
            "build_started_at": _event_time(job.started_at),
            "build_finished_at": _event_time(job.finished_at),
            "build_created_at_iso": iso(job.created_at),
            "build_started_at_iso": iso(job.started_at),
            "build_finished_at_iso": iso(job.finished_at),
            "build_duration": duration,
            "build_queued_duration": None,
            "build_allow_failure": False,
            "build_failure_reason": job.failure_reason or "unknown_failure",
            "pipeline_id": job.pipeline_id,
            "runner": runner.brief() if runner else None,
            "project_id": job.project_id,
            "project_name": job.project.replace("/", " / "),
            "user": {"id": 1, "name": "Fake User", "username": "fake", "email": "[REDACTED]"},
            "commit": {
                "id": job.pipeline_id,
                "name": job.pipeline,
                "sha": "1" * 40,
                "message": "a change\n",
                "status": job.status,
            },
            "repository": {"name": job.project.split("/")[-1], "homepage": f"{self._base()}/{job.project}"},
            "project": {"id": job.project_id, "path_with_namespace": job.project},
            "environment": None,
        }
        return payload

    def _base(self) -> str:
        return self.url if self._server is not None else "http://gitlab.invalid"

    def _event(self, job: Job) -> None:
        """Queue the job's Job event for its current status (the lock is held)."""
        delivery = Delivery(
            next(self._ids), str(uuid.uuid4()), job.id, job.status, json.dumps(self._payload(job)).encode()
        )
        if self.rng.random() < self.lost_rate:
            return  # dropped: GitLab never sends it again
        self.deliveries.append(delivery)
        self.outbox.append((delivery, False))
        if self.rng.random() < self.duplicate_rate:
            self.outbox.append((delivery, True))  # the same event (the same Idempotency-Key) again
        self.changed.notify_all()

    def _delivery_headers(self, delivery: Delivery) -> dict[str, str]:
        return {
            "User-Agent": "GitLab/17.9.0-fake",
            "X-Gitlab-Event": "Job Hook",
            "X-Gitlab-Token": self.webhook_token,
            "X-Gitlab-Event-UUID": delivery.key,
            "Idempotency-Key": delivery.key,
            "X-Gitlab-Webhook-UUID": "00000000-0000-4000-8000-000000000001",
            "X-Gitlab-Instance": self._base(),
        }

    def delivery_for(self, job_id: int, status: str) -> Delivery | None:
        """The first delivery of ``job_id``'s ``status`` event (the bench times them)."""
        with self.lock:
            return next((d for d in self.deliveries if d.job_id == job_id and d.status == status), None)

    # ---- jobs and runners ------------------------------------------------------------------------

    def sweep(self) -> None:
        with self.lock:
            now = time.time()
            for job in list(self.jobs.values()):
                if job.status != "running":
                    continue
                # GitLab drops a running job nobody updated (its runner deleted or not)
                if now - (job.updated_at or job.started_at or now) > self.lost_after:
                    job.failure_reason = "stuck_or_timeout_failure"
                    self._finish(job, "failed")

    def _finish(self, job: Job, status: str) -> None:
        job.status, job.finished_at = status, time.time()
        self._event(job)
        self.changed.notify_all()

    def _take(self, runner: Runner) -> Job | None:
        """The oldest pending job this runner may run: its tags are all the runner's (an untagged
        job only for a runner that runs untagged ones), of the runner's project or group."""
        if runner.paused:
            return None
        mine = {t.lower() for t in runner.tags}
        for job in sorted(self.jobs.values(), key=lambda j: j.id):
            if job.status != "pending":
                continue
            wanted = {t.lower() for t in job.tags}
            if not wanted and not runner.run_untagged:
                continue
            if not wanted <= mine:
                continue
            if runner.runner_type == "project_type" and job.project_id != runner.project_id:
                continue
            if (
                runner.runner_type == "group_type"
                and self.projects[job.project_id].group_id != runner.group_id
            ):
                continue
            job.status, job.started_at, job.runner_id = "running", time.time(), runner.id
            job.updated_at = job.started_at
            runner.job_id = job.id  # its latest: GitLab counts none (a runner may run many)
            self._event(job)
            return job
        return None

    # ---- HTTP --------------------------------------------------------------------------------------

    def _route(
        self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, Any], raw: bytes
    ) -> tuple[int, Any, dict[str, str]]:
        if _runner_side(path):
            status, body = self._runner_api(handler, path, raw)
            return status, body, {}
        if path.startswith("/api/v4/"):
            return self._rest(handler, path[len("/api/v4") :], query, raw)
        raise HttpError(404, "404 Not Found")

    def _record(self, method: str, path: str, route: str, status: int) -> None:
        if _runner_side(path):
            self.runner_calls.append((method, route, status))
        elif not path.startswith("/_fake/"):
            self.calls.append((method, route.removeprefix("/api/v4"), status))

    def _queue_from(self, body: dict[str, Any]) -> int:
        return self.queue_job(
            str(body["project"]),
            list(body.get("tags") or []),
            list(body.get("script") or []) or None,
            pipeline=str(body.get("pipeline", "CI")),
            name=str(body.get("name", "build")),
            stage=str(body.get("stage", "test")),
            ref=str(body.get("ref", "main")),
            image=str(body["image"]) if body.get("image") else None,
            services=list(body.get("services") or []),
        )

    def _job_json(self, job: Job) -> dict[str, Any]:
        return job.as_json(self.runners)

    def _more_faults(self, body: dict[str, Any]) -> None:
        if "runner_cap" in body:
            self.runner_cap = None if body["runner_cap"] is None else int(body["runner_cap"])

    def _rate_headers(self) -> dict[str, str]:
        now = time.time()
        with self.lock:
            if now - self._rate_window >= 60:
                self._rate_window, self._rate_used = now, 0
            self._rate_used += 1
            used = self._rate_used
        reset = int(self._rate_window + 60)
        return {
            "RateLimit-Limit": str(self.rate_limit),
            "RateLimit-Observed": str(used),
            "RateLimit-Remaining": str(max(0, self.rate_limit - used)),
            "RateLimit-Reset": str(reset),
            "RateLimit-ResetTime": datetime.fromtimestamp(reset, UTC).strftime("%a, %d %b %Y %H:%M:%S GMT"),
        }

    def _rest(
        self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, Any], raw: bytes
    ) -> tuple[int, Any, dict[str, str]]:
        method = handler.command
        if self.latency:
            time.sleep(self.latency)
        token = handler.headers.get("PRIVATE-TOKEN") or handler.headers.get("Authorization", "").removeprefix(
            "Bearer "
        )
        if not self.token or token != self.token:
            raise HttpError(401, "401 Unauthorized")
        now = time.time()
        if now < self.rate_limited_until:
            wait = int(self.rate_limited_until - now) + 1
            raise HttpError(
                429,
                "Retry later",
                {
                    "Retry-After": str(wait),
                    "RateLimit-Limit": str(self.rate_limit),
                    "RateLimit-Remaining": "0",
                    "RateLimit-Reset": str(int(self.rate_limited_until) + 1),
                },
            )
        self._inject_faults(method, path)
        headers = self._rate_headers()
        body = json.loads(raw) if raw else {}
        with self.lock:
            if path == "/user/runners" and method == "POST":
                return 201, self._create_runner(body), headers
            if path == "/runners" and method == "GET":
                now = time.time()
                items = [
                    r.as_json(now, self.offline_after)
                    for r in sorted(self.runners.values(), key=lambda r: r.id)
                ]
                return 200, self._page(query, items, headers), headers
            if m := re.fullmatch(r"/runners/(\d+)(?:/(jobs|managers|reset_authentication_token))?", path):
                return (
                    *self._runner_rest(method, int(m.group(1)), m.group(2) or "", query, body, headers),
                    headers,
                )
            if m := re.fullmatch(r"/projects/(\d+)/jobs(?:/(\d+)(/cancel)?)?", path):
                project = self.projects.get(int(m.group(1)))
                if project is None:
                    raise HttpError(404, "404 Project Not Found")
                return (
                    *self._jobs_rest(method, project, m.group(2), bool(m.group(3)), query, headers),
                    headers,
                )
        raise HttpError(404, "404 Not Found")

    @staticmethod
    def _page(query: dict[str, Any], items: list[Any], headers: dict[str, str]) -> list[Any]:
        per_page = max(1, min(100, int(query.get("per_page", 20))))
        page = max(1, int(query.get("page", 1)))
        headers["X-Total"] = str(len(items))
        headers["X-Page"] = str(page)
        if page * per_page < len(items):
            headers["X-Next-Page"] = str(page + 1)
        return items[(page - 1) * per_page : page * per_page]

    def _create_runner(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = body.get("runner_type")
        if kind == "instance_type":
            raise HttpError(403, "403 Forbidden")
        if kind not in ("project_type", "group_type"):
            raise HttpError(400, "runner_type does not have a valid value")
        project_id = body.get("project_id") if kind == "project_type" else None
        group_id = body.get("group_id") if kind == "group_type" else None
        if kind == "project_type" and project_id not in self.projects:
            raise HttpError(404, "404 Project Not Found")
        if kind == "group_type" and not any(p.group_id == group_id for p in self.projects.values()):
            raise HttpError(404, "404 Group Not Found")
        tags = body.get("tag_list") or []
        if isinstance(tags, str):
            tags = [t.strip() for t in tags.split(",") if t.strip()]
        timeout = body.get("maximum_timeout")
        if timeout is not None and int(timeout) < 600:
            raise HttpError(400, "maximum_timeout needs to be at least 10 minutes")
        self._check_cap(str(kind), project_id, group_id)
        fault = self.runner_faults.popleft() if self.runner_faults else None
        runner = Runner(
            id=next(self._ids),
            token="glrt-" + secrets.token_urlsafe(20),
            description=str(body.get("description") or ""),
            tags=[str(t) for t in tags],
            run_untagged=bool(body.get("run_untagged", True)),
            runner_type=str(kind),
            project_id=project_id,
            group_id=group_id,
            maximum_timeout=int(timeout or 3600),
            fault=fault,
            paused=bool(body.get("paused", False)),
            created_at=self.now(),
        )
        self.runners[runner.id] = runner
        self.all_runners[runner.id] = runner
        self.runner_created_at[runner.id] = runner.created_at
        self.runners_seen[runner.id] = runner.description
        self.issued_tokens.append(runner.token)
        self.max_runners_seen = max(self.max_runners_seen, len(self.runners))
        return {"id": runner.id, "token": runner.token, "token_expires_at": None}

    def _status_at(self, contacted: float | None) -> str:
        if contacted is None:
            return "never_contacted"
        return "online" if self.now() - contacted < self.offline_after else "offline"

    def _check_cap(self, kind: str, project_id: Any, group_id: Any) -> None:
        """GitLab.com's cap: a project (group) may have ``runner_cap`` runners created or active
        (contacted) in the past seven days, deleted ones included (plan limits
        ``ci_registered_project_runners`` / ``ci_registered_group_runners``; the refusal is
        Limitable's "Maximum number of %{name} (%{count}) exceeded", a 400)."""
        if self.runner_cap is None:
            return
        since = self.now() - 7 * 86400
        scope = "project" if kind == "project_type" else "group"
        counted = sum(
            1
            for r in self.all_runners.values()
            if (r.project_id if scope == "project" else r.group_id)
            == (project_id if scope == "project" else group_id)
            and (r.created_at >= since or (r.contacted_at or 0) >= since)
        )
        if counted >= self.runner_cap:
            self.cap_refusals += 1
            raise HttpError(
                400,
                f"400 Bad request - Maximum number of ci registered {scope} runners "
                f"({self.runner_cap}) exceeded",
            )

    def _runner_rest(
        self,
        method: str,
        runner_id: int,
        jobs: str,
        query: dict[str, Any],
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> tuple[int, Any]:
        runner = self.runners.get(runner_id)
        if runner is None:
            raise HttpError(404, "404 Runner Not Found")
        now = time.time()
        if jobs == "managers" and method == "GET":
            return 200, [
                {"id": i + 1, "system_id": sid, "contacted_at": iso(at), "status": self._status_at(at)}
                for i, (sid, at) in enumerate(sorted(runner.managers.items()))
            ]
        if jobs == "reset_authentication_token" and method == "POST":
            # the old token is refused from now on (Ci::Runner#reset_token!); running jobs go on
            runner.token = "glrt-" + secrets.token_urlsafe(20)
            self.issued_tokens.append(runner.token)
            return 201, {"token": runner.token, "token_expires_at": None}
        if jobs == "jobs" and method == "GET":
            mine = [j for j in self.jobs.values() if j.runner_id == runner.id]
            if query.get("status"):
                mine = [j for j in mine if j.status == query["status"]]
            return 200, self._page(query, [j.as_json(self.runners) for j in mine], headers)
        if method == "GET":
            return 200, runner.as_json(now, self.offline_after)
        if method == "PUT":
            if "paused" in body:
                runner.paused = bool(body["paused"])
            return 200, runner.as_json(now, self.offline_after)
        if method == "DELETE":
            self.runners.pop(runner.id, None)
            self.deleted_runners.append(runner.id)
            self.changed.notify_all()
            return 204, None
        raise HttpError(405, "405 Method Not Allowed")

    def _jobs_rest(
        self,
        method: str,
        project: Project,
        job_id: str | None,
        cancel: bool,
        query: dict[str, Any],
        headers: dict[str, str],
    ) -> tuple[int, Any]:
        if job_id is None:
            if method != "GET":
                raise HttpError(405, "405 Method Not Allowed")
            scopes = query.get("scope[]") or query.get("scope") or []
            scopes = [scopes] if isinstance(scopes, str) else list(scopes)
            mine = sorted((j for j in self.jobs.values() if j.project_id == project.id), key=lambda j: -j.id)
            if scopes:
                mine = [j for j in mine if j.status in scopes]
            return 200, self._page(query, [j.as_json(self.runners) for j in mine], headers)
        job = self.jobs.get(int(job_id))
        if job is None or job.project_id != project.id:
            raise HttpError(404, "404 Not found")
        if cancel and method == "POST":
            self.cancel_job(job.id)
            return 201, job.as_json(self.runners)
        if method == "GET" and not cancel:
            return 200, job.as_json(self.runners)
        raise HttpError(405, "405 Method Not Allowed")

    # ---- the runner API (the stand-in gitlab-runner's) ---------------------------------------------

    def _runner_api(self, handler: BaseHTTPRequestHandler, path: str, raw: bytes) -> tuple[int, Any]:
        body = json.loads(raw) if raw else {}
        method = handler.command
        with self.changed:
            if path == "/api/v4/runners/verify" and method == "POST":
                runner = self._runner_by_token(body.get("token"))
                if runner.fault != "never_connect":  # the fault: its contact never arrives
                    self._contact(runner)
                return 200, {
                    "id": runner.id,
                    "token": runner.token,
                    "token_expires_at": None,
                    "fault": runner.fault,
                }
            if path == "/api/v4/jobs/request" and method == "POST":
                runner = self._runner_by_token(body.get("token"))
                system_id = str(body.get("system_id") or "")
                deadline = time.time() + min(30.0, float(body.get("wait") or 0))
                while True:
                    if runner.id not in self.runners or runner.token != body.get("token"):
                        raise HttpError(403, "403 Forbidden")  # deleted (or its token reset) meanwhile
                    if runner.fault != "never_connect":  # the fault: its contact never arrives
                        self._contact(runner, system_id)
                        job = self._take(runner)  # whatever it runs already (see the docstring)
                        if job is not None:
                            job.system_id = system_id or None
                            return 201, self._job_payload(job, runner)
                    remaining = deadline - time.time()
                    if remaining <= 0 or self._stop.is_set():
                        return 204, None
                    self.changed.wait(min(remaining, 1.0))
            m = re.fullmatch(r"/api/v4/jobs/(\d+)(/trace)?", path)
            job = self.jobs.get(int(m.group(1))) if m else None
            token = body.get("token") or handler.headers.get("JOB-TOKEN")
            if job is None or token != job.token:
                raise HttpError(403, "403 Forbidden")
            # the job's token alone: its runner may have been deleted since (GitLab's
            # authenticate_job!, job.runner&.heartbeat)
            current = self.runners.get(job.runner_id) if job.runner_id else None
            if current is not None:
                self._contact(current)
            if job.status != "running":
                raise HttpError(403, "403 Forbidden - Job is not running")  # canceled: the runner stops
            job.updated_at = time.time()
            if m and m.group(2):  # a trace update: the job is alive
                return 202, None
            state = str(body.get("state") or "")
            if state in ("success", "failed"):
                if current is not None and current.job_id == job.id:
                    current.job_id = None
                job.failure_reason = (
                    str(body.get("failure_reason") or "script_failure") if state == "failed" else None
                )
                self._finish(job, state)
            return 200, None

    def _runner_by_token(self, token: Any) -> Runner:
        runner = next((r for r in self.runners.values() if r.token == token), None)
        if runner is None:
            raise HttpError(403, "403 Forbidden")
        return runner

    def _contact(self, runner: Runner, system_id: str = "") -> None:
        runner.contacted_at = self.now()
        if system_id:
            runner.managers[system_id] = runner.contacted_at
        self.runner_online_at.setdefault(runner.id, runner.contacted_at)

    def _job_payload(self, job: Job, runner: Runner) -> dict[str, Any]:
        variables = {  # some of GitLab's predefined variables
            "CI_SERVER_URL": self._base(),
            "CI_JOB_TOKEN": job.token,
            "CI_JOB_ID": str(job.id),
            "CI_JOB_NAME": job.name,
            "CI_JOB_STAGE": job.stage,
            "CI_PIPELINE_ID": str(job.pipeline_id),
            "CI_PROJECT_ID": str(job.project_id),
            "CI_PROJECT_PATH": job.project,
            "CI_COMMIT_REF_NAME": job.ref,
            "CI_RUNNER_ID": str(runner.id),
            "CI_RUNNER_DESCRIPTION": runner.description,
            "CI_RUNNER_TAGS": json.dumps(runner.tags),
        }
        return {
            "id": job.id,
            "token": job.token,
            "allow_git_fetch": False,
            "job_info": {
                "id": job.id,
                "name": job.name,
                "stage": job.stage,
                "project_id": job.project_id,
                "project_name": job.project,
            },
            "git_info": {"repo_url": f"{self._base()}/{job.project}.git", "ref": job.ref, "sha": "1" * 40},
            "runner_info": {"timeout": runner.maximum_timeout},
            "variables": [
                {"key": k, "value": v, "public": True, "masked": False} for k, v in variables.items()
            ],
            "steps": [
                {
                    "name": "script",
                    "script": list(job.script),
                    "timeout": runner.maximum_timeout,
                    "when": "on_success",
                }
            ],
            # gitlabhq lib/api/entities/ci/job_request/image.rb: name, entrypoint, ports (and
            # pull_policy behind a feature flag); ``image`` is null for a job that names none
            "image": {"name": job.image, "entrypoint": None, "ports": []} if job.image else None,
            # gitlabhq lib/api/entities/ci/job_request/service.rb: name, entrypoint, ports, alias,
            # command, variables
            "services": [
                {
                    "name": service["name"],
                    "entrypoint": service.get("entrypoint"),
                    "ports": [],
                    "alias": service.get("alias"),
                    "command": service.get("command"),
                    "variables": service.get("variables") or [],
                }
                for service in job.services
            ],
            "fault": runner.fault,
        }

    # ---- controls over HTTP (make dev, another process) --------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Serve the fake until interrupted (``make dev`` runs it this way when asked to)."""
    parser = argparse.ArgumentParser(prog="python -m testkit.gitlab_fake", description=__doc__)
    parser.add_argument("--port", type=int, default=8071)
    parser.add_argument("--token-file", required=True, help="the access token Catacloud uses")
    parser.add_argument("--webhook-token-file", required=True, help="the webhook's secret token")
    parser.add_argument("--webhook-url", required=True)
    parser.add_argument("--project", action="append", default=[], help="id:path (repeatable)")
    args = parser.parse_args(argv)
    from pathlib import Path

    fake = FakeGitLab(
        token=Path(args.token_file).read_text().strip(),
        webhook_token=Path(args.webhook_token_file).read_text().strip(),
        webhook_url=args.webhook_url,
        port=args.port,
    )
    for item in args.project or ["1:demo-group/app"]:
        ident, _, path = item.partition(":")
        fake.add_project(int(ident), path)
    fake.start()
    print(f"fake GitLab at {fake.url} (controls: POST {fake.url}/_fake/jobs)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
