"""The one GitLab client: every call Catacloud makes to GitLab (GitLab.com or self-managed, REST
API v4) goes through :class:`GitLabClient`, the CI core's client machinery
(apps.ci.client.ForgeClient: ``RateLimit-*`` and ``Retry-After`` honoured, retries, the
per-connection request budget ``CATACLOUD_GITLAB_REQUEST_BUDGET``, GitLab paused and runner jobs
held while it fails) authenticated with the connection's access token (``PRIVATE-TOKEN``).

Why not python-gitlab: Catacloud calls seven endpoints, and each call must go through the one
budget, the availability pause and the rate-limit bookkeeping every forge shares; python-gitlab
would be wrapped call by call for that (its own retries sleep in the worker on 429), so the
core's client is the simpler one client for both forges. Never logs a token or a body.

Its answers are typed values (:class:`CreatedRunner`, :class:`RunnerInfo`, :class:`JobInfo`),
each read from GitLab's JSON in one place, its ``from_api``; the callers (apps.gitlab.ops,
apps.gitlab.intake) write the rows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from apps.ci.client import ForgeClient, int_or_none, iso_when
from apps.ci.errors import ForgeNotFound, ForgeRateLimited, ForgeRefused
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import GitLabConnection

# Limitable's refusal (gitlabhq app/models/concerns/limitable.rb: "Maximum number of %{name}
# (%{count}) exceeded"), for the plan limits ci_registered_project_runners / _group_runners.
CAP_REFUSAL = re.compile(r"Maximum number of ci registered (project|group) runners \((\d+)\) exceeded")


class RunnerCapReached(ForgeRateLimited):
    """GitLab's cap on the runners of a project (group) in seven days refused a new one."""

    def __init__(self, detail: str, retry_after: float, *, cap: int, **kw: Any) -> None:
        super().__init__(detail, retry_after, **kw)
        self.cap = cap


def parse_when(value: Any) -> datetime | None:
    """ISO 8601 (the API, the events' ``*_iso``) or the events' ``2021-01-13 17:57:05 UTC``."""
    if not isinstance(value, str) or not value:
        return None
    parsed = iso_when(value)
    if parsed is not None:
        return parsed
    try:
        return datetime.strptime(value, "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC)
    except ValueError:
        return None


def parse_tags(value: Any) -> list[str] | None:
    """A job's tags, lower-case; None when it is not a list of strings."""
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        return None
    return [t.lower() for t in value]


def mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class CreatedRunner:
    """A runner just created (``POST /user/runners``)."""

    id: int
    token: str  # the ``glrt-`` secret the machine registers with: never logged

    def __repr__(self) -> str:
        return f"CreatedRunner(id={self.id})"

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> CreatedRunner:
        return cls(int(body["id"]), str(body["token"]))


@dataclass(frozen=True)
class RunnerInfo:
    """A runner GitLab lists (``GET /runners``)."""

    id: int
    description: str  # our runners' name
    online: bool

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> RunnerInfo:
        return cls(int(body["id"]), str(body.get("description") or ""), body.get("status") == "online")


@dataclass(frozen=True)
class JobInfo:
    """A job of the jobs API (``GET /projects/:id/jobs``, ``.../jobs/:job_id``,
    ``/runners/:id/jobs``). Read leniently: a field missing or of the wrong kind is None (``id``:
    then it is no job we can record) or empty."""

    id: int | None
    status: str
    tags: tuple[str, ...]  # lower-case; empty when GitLab says none (or not a list of strings)
    ref: str
    name: str
    stage: str
    pipeline_id: int | None
    pipeline: str  # the pipeline's name, else the ref
    runner_id: int | None
    runner_name: str  # the runner's description
    runner_manager: str  # the runner manager's system id ("" when GitLab names none)
    started_at: datetime | None
    finished_at: datetime | None
    failure_reason: str

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> JobInfo:
        pipeline, runner = mapping(body.get("pipeline")), mapping(body.get("runner"))
        pipeline_id, runner_id = pipeline.get("id"), runner.get("id")
        return cls(
            id=int_or_none(body.get("id")),
            status=str(body.get("status") or ""),
            tags=tuple(parse_tags(body.get("tag_list")) or []),
            ref=str(body.get("ref") or ""),
            name=str(body.get("name") or ""),
            stage=str(body.get("stage") or ""),
            pipeline_id=pipeline_id if isinstance(pipeline_id, int) else None,
            pipeline=str(pipeline.get("name") or body.get("ref") or ""),
            runner_id=runner_id if isinstance(runner_id, int) else None,
            runner_name=str(runner.get("description") or ""),
            runner_manager=str(mapping(body.get("runner_manager")).get("system_id") or ""),
            started_at=parse_when(body.get("started_at")),
            finished_at=parse_when(body.get("finished_at")),
            failure_reason=str(body.get("failure_reason") or ""),
        )


class GitLabClient(ForgeClient):
    """Calls to one connection's GitLab."""

    forge = GITLAB
    remaining_header = "ratelimit-remaining"
    reset_header = "ratelimit-reset"
    limit_statuses = (429,)

    def __init__(self, connection: GitLabConnection) -> None:
        self.connection = connection
        super().__init__(connection)

    def base_url(self) -> str:
        return self.connection.api_url

    def headers(self, auth: str) -> dict[str, str]:
        return {
            "Accept": "application/json",
            "User-Agent": "catacloud",
            "PRIVATE-TOKEN": self.connection.token,
        }

    # ---- the endpoints Catacloud uses -------------------------------------------------------

    def create_runner(self, body: dict[str, Any]) -> CreatedRunner:
        """``POST /user/runners``: a project or group runner; answers its id and ``glrt-`` token.
        GitLab.com's runner cap refusing it (a 400 "Maximum number of ci registered project
        runners (50) exceeded") is a limit, not a refusal: :class:`RunnerCapReached`."""
        try:
            return CreatedRunner.from_api(self.request("POST", "/user/runners", json=body))
        except ForgeRefused as exc:
            cap = CAP_REFUSAL.search(exc.detail)
            if cap is None:
                raise
            raise RunnerCapReached(
                f"GitLab's runner cap: {cap.group(2)} runners created or active in the past seven days "
                f"per {cap.group(1)} (GitLab.com Free 50, paid tiers 1,000)",
                retry_after=3600.0,
                status=exc.status,
                paced=True,
                scoped=True,
                cap=int(cap.group(2)),
            ) from None

    def reset_runner_token(self, runner_id: int) -> str:
        """``POST /runners/:id/reset_authentication_token``: a new token; the old one is refused
        from now on (jobs already running go on with their own job tokens)."""
        return str(self.request("POST", f"/runners/{runner_id}/reset_authentication_token")["token"])

    def delete_runner(self, runner_id: int, *, background: bool = False) -> bool:
        """``DELETE /runners/:id``; False when it was already gone (404)."""
        try:
            self.request("DELETE", f"/runners/{runner_id}", background=background)
        except ForgeNotFound:
            return False
        return True

    def pause_runner(self, runner_id: int) -> None:
        """``PUT /runners/:id`` paused: it takes no job any more."""
        self.request("PUT", f"/runners/{runner_id}", json={"paused": True})

    def runner_jobs(self, runner_id: int, *, status: str) -> list[JobInfo]:
        answer = self.request("GET", f"/runners/{runner_id}/jobs", params={"status": status, "per_page": 20})
        return [JobInfo.from_api(j) for j in answer] if isinstance(answer, list) else []

    def runners(self) -> list[RunnerInfo]:
        """``GET /runners``: the runners the token's user owns (project and group runners)."""
        return [RunnerInfo.from_api(r) for r in self.paged("/runners", None, background=True)]

    def project_jobs(self, project_id: int, scopes: list[str]) -> list[JobInfo]:
        jobs = self.paged(f"/projects/{project_id}/jobs", None, params={"scope[]": scopes}, background=True)
        return [JobInfo.from_api(j) for j in jobs]

    def job(self, project_id: int, job_id: int, *, background: bool = True) -> JobInfo:
        body = self.request("GET", f"/projects/{project_id}/jobs/{job_id}", background=background)
        return JobInfo.from_api(dict(body))
