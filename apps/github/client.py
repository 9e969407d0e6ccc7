"""The one GitHub client: every call Catacloud makes to GitHub goes through :class:`GitHubClient`,
a :class:`apps.ci.client.ForgeClient` (the limits, retries, availability and request budget
every forge's client shares) that authenticates as GitHub wants:

- **Auth**: the App's JWT (RS256, signed by PyJWT with ``cryptography``'s RSA: no hand-rolled
  crypto) for App endpoints, and installation tokens for the rest, cached encrypted on the
  installation row (shared by every process) until 5 minutes before they expire (the cache's
  rows: apps.github.services).
- **Answers**: typed values (:class:`RunnerInfo`, :class:`WorkflowJobInfo`, ...), each read from
  GitHub's JSON in one place, its ``from_api``; the callers (apps.github.ops) write the rows.
- **Limits**: ``x-ratelimit-remaining`` / ``x-ratelimit-reset`` are recorded after every
  answer; a 403/429 with ``Retry-After`` (secondary limits) or an exhausted primary limit makes
  the installation unavailable until then (``CATACLOUD_GITHUB_REQUEST_BUDGET`` calls per hour
  of our own, the reconciler's polls stopping at 80 % of it).
- Never logs a token, a key or a body.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jwt
import requests
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from django.conf import settings
from django.utils import timezone

from apps.ci.client import POLL_SHARE, SESSION, ForgeClient, Window, int_or_none, iso_when, message
from apps.ci.errors import (
    ForgeConflict,
    ForgeError,
    ForgeNotFound,
    ForgeRateLimited,
    ForgeRefused,
    ForgeUnavailable,
    ForgeUnprocessable,
    refused,
)
from apps.github.forge import GITHUB
from apps.github.models import GitHubInstallation
from apps.github.services import installation_token_cached, installation_token_drop, installation_token_store

API_VERSION = "2022-11-28"

# GitHub's names for the core's failures (the same classes).
GitHubError = ForgeError
GitHubUnavailable = ForgeUnavailable
GitHubRateLimited = ForgeRateLimited
GitHubRefused = ForgeRefused
GitHubNotFound = ForgeNotFound
GitHubConflict = ForgeConflict  # 409: e.g. a runner with this name exists already
GitHubUnprocessable = ForgeUnprocessable  # 422: e.g. a busy runner cannot be deleted


def app_jwt(app_id: int, private_key: str, now: float | None = None) -> str:
    """The App's JSON Web Token: RS256, issued 60 s in the past (clock drift), valid 9 minutes
    (GitHub accepts at most 10)."""
    issued = int(now if now is not None else time.time()) - 60
    claims = {"iat": issued, "exp": issued + 600 - 60, "iss": str(app_id)}
    return jwt.encode(claims, _signing_key(private_key), "RS256")


@functools.lru_cache(maxsize=16)
def _signing_key(pem: str) -> Any:
    """The App's key, parsed once per process: parsing a PEM (with its RSA checks) took 54 ms a
    signature here against 1 ms for the signing itself, on every installation token and every
    App call (the reconciler's redelivery listing). Checked when the App was connected."""
    return load_pem_private_key(pem.encode(), password=None)


@dataclass(frozen=True)
class JitRunner:
    runner_id: int
    name: str
    encoded_jit_config: str  # the secret: never logged, never returned by our API

    def __repr__(self) -> str:  # a stray log line must not print the config
        return f"JitRunner(runner_id={self.runner_id}, name={self.name!r})"

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> JitRunner:
        return cls(int(body["runner"]["id"]), str(body["runner"]["name"]), str(body["encoded_jit_config"]))


@dataclass(frozen=True)
class RunnerInfo:
    """A self-hosted runner GitHub lists (``GET {owner_path}/actions/runners``)."""

    id: int
    name: str
    online: bool
    busy: bool

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> RunnerInfo:
        return cls(
            int(body["id"]), str(body.get("name", "")), body.get("status") == "online", bool(body.get("busy"))
        )


@dataclass(frozen=True)
class Repository:
    """A repository the installation can see (``GET /installation/repositories``)."""

    full_name: str  # ``owner/name``

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> Repository:
        return cls(str(body.get("full_name", "")))


@dataclass(frozen=True)
class WorkflowRun:
    """A workflow run (``GET /repos/{repository}/actions/runs``)."""

    id: int
    name: str  # the workflow's name

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> WorkflowRun:
        return cls(int(body["id"]), str(body.get("name") or ""))


@dataclass(frozen=True)
class WorkflowJobInfo:
    """A workflow job as GitHub describes it: the REST API's (``GET .../jobs``) or a
    ``workflow_job`` delivery's, the same shape. Read leniently: a field missing or of the wrong
    kind is None (``id``, ``run_id``, ``run_attempt``: then it is no workflow job we can record)
    or empty."""

    id: int | None
    run_id: int | None
    run_attempt: int | None  # 1 when GitHub does not say; None when it is not a number
    status: str
    workflow_name: str | None  # None when GitHub does not say (the poll takes its run's)
    name: str
    labels: tuple[str, ...]
    runner_name: str
    runner_id: int | None
    started_at: datetime | None
    completed_at: datetime | None
    conclusion: str

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> WorkflowJobInfo:
        runner_id = body.get("runner_id")
        return cls(
            id=int_or_none(body.get("id")),
            run_id=int_or_none(body.get("run_id")),
            run_attempt=int_or_none(body.get("run_attempt") or 1),
            status=str(body.get("status") or ""),
            workflow_name=str(body["workflow_name"] or "") if "workflow_name" in body else None,
            name=str(body.get("name") or ""),
            labels=tuple(str(label) for label in body.get("labels") or []),
            runner_name=str(body.get("runner_name") or ""),
            runner_id=runner_id if isinstance(runner_id, int) else None,
            started_at=iso_when(body.get("started_at")),
            completed_at=iso_when(body.get("completed_at")),
            conclusion=str(body.get("conclusion") or ""),
        )


def next_cursor(link: str) -> str | None:
    """The ``cursor`` of a ``Link`` header's ``rel="next"`` URL, if any."""
    for part in link.split(","):
        url, _, rel = part.partition(";")
        if 'rel="next"' in rel:
            cursor = parse_qs(urlsplit(url.strip().strip("<>")).query).get("cursor")
            return cursor[0] if cursor else None
    return None


@dataclass(frozen=True)
class HookDelivery:
    """One delivery of the App's webhook (``GET /app/hook/deliveries``)."""

    id: int
    guid: str | None
    status_code: int  # 0 when GitHub does not say (no answer: a timeout, a connection refused)
    event: str | None
    action: str | None
    delivered_at: datetime | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def worth_redelivering(self) -> bool:
        """Failed on our side's way (no answer, a 5xx, 408 or 429): a 4xx we answered (a bad
        signature, 413, 415) would be answered the same again."""
        return not self.ok and (self.status_code in (0, 408, 429) or self.status_code >= 500)

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> HookDelivery:
        guid, event, action = body.get("guid"), body.get("event"), body.get("action")
        return cls(
            id=int(body["id"]),
            guid=None if guid is None else str(guid),
            status_code=int(body.get("status_code") or 0),
            event=None if event is None else str(event),
            action=None if action is None else str(action),
            delivered_at=iso_when(body.get("delivered_at")),
        )


@dataclass(frozen=True)
class InstallationToken:
    """An installation access token (``POST /app/installations/{id}/access_tokens``)."""

    token: str  # the secret: never logged
    expires_at: datetime

    def __repr__(self) -> str:
        return f"InstallationToken(expires_at={self.expires_at.isoformat()})"

    @classmethod
    def from_api(cls, body: Mapping[str, Any]) -> InstallationToken:
        expires = datetime.fromisoformat(str(body["expires_at"]).replace("Z", "+00:00"))
        return cls(str(body["token"]), expires)


# GitHub's documented secondary limits (docs.github.com, "Rate limits for the REST API"), and our
# pacing below them (the figures we keep, ``most``): at most 900 points a minute for one REST
# endpoint (a GET 1 point, a POST/PATCH/PUT/DELETE 5); at most 80 content-creating requests a
# minute and 500 an hour (a just-in-time runner registration creates a runner).
ENDPOINT_POINTS = (900, 720)
CREATIONS_PER_MINUTE = (80, 72)
CREATIONS_PER_HOUR = (500, 450)
CREATING = re.compile(r"/(orgs/[^/]+|repos/[^/]+/[^/]+)/actions/runners/generate-jitconfig")


def endpoint_of(method: str, path: str) -> str:
    """A call's REST endpoint (its route: owners, repositories and ids as placeholders), what
    GitHub counts points per."""
    path = re.sub(r"^/repos/[^/]+/[^/]+", "/repos/{owner}/{repo}", path)
    path = re.sub(r"^/orgs/[^/]+", "/orgs/{org}", path)
    return f"{method} " + re.sub(r"/[0-9]+(?=/|$)", "/{id}", path)


class GitHubClient(ForgeClient):
    """Calls to GitHub for one installation (and its connection's App)."""

    forge = GITHUB
    remaining_header = "x-ratelimit-remaining"
    reset_header = "x-ratelimit-reset"
    limit_statuses = (403, 429)
    limit_words = ("rate limit", "abuse")
    # "wait for at least one minute before retrying" (docs.github.com, "Rate limits for the REST
    # API": exceeding a secondary rate limit)
    secondary_minimum = 60.0

    def __init__(self, installation: GitHubInstallation) -> None:
        self.installation = installation
        self.connection = installation.connection
        super().__init__(installation)

    # ---- the endpoints Catacloud uses -------------------------------------------------------

    def generate_jitconfig(
        self, *, owner_path: str, name: str, labels: list[str], runner_group_id: int
    ) -> JitRunner:
        """``POST {owner_path}/actions/runners/generate-jitconfig`` (owner_path: ``/orgs/ORG``
        or ``/repos/OWNER/REPO``)."""
        body = self.request(
            "POST",
            f"{owner_path}/actions/runners/generate-jitconfig",
            json={"name": name, "runner_group_id": runner_group_id, "labels": labels, "work_folder": "_work"},
        )
        return JitRunner.from_api(body)

    def list_runners(self, *, owner_path: str, background: bool = True) -> list[RunnerInfo]:
        runners = self.paged(f"{owner_path}/actions/runners", "runners", background=background)
        return [RunnerInfo.from_api(r) for r in runners]

    def runner_by_name(self, *, owner_path: str, name: str) -> RunnerInfo | None:
        body = self.request("GET", f"{owner_path}/actions/runners", params={"name": name, "per_page": 100})
        found = next((r for r in body.get("runners", []) if r.get("name") == name), None)
        return None if found is None else RunnerInfo.from_api(found)

    def delete_runner(self, *, owner_path: str, runner_id: int, background: bool = False) -> bool:
        """Delete a registered runner; False when it was already gone (404). A busy runner:
        :class:`GitHubUnprocessable` (GitHub refuses while it runs a job)."""
        try:
            self.request("DELETE", f"{owner_path}/actions/runners/{runner_id}", background=background)
        except GitHubNotFound:
            return False
        return True

    def repositories(self) -> list[Repository]:
        return [
            Repository.from_api(r)
            for r in self.paged("/installation/repositories", "repositories", background=POLL_SHARE)
        ]

    def runs(self, repository: str, status: str) -> list[WorkflowRun]:
        runs = self.paged(
            f"/repos/{repository}/actions/runs",
            "workflow_runs",
            params={"status": status},
            background=POLL_SHARE,
        )
        return [WorkflowRun.from_api(r) for r in runs]

    def queued_runs(self, repository: str) -> list[WorkflowRun]:
        return self.runs(repository, "queued")

    def run_jobs(self, repository: str, run_id: int) -> list[WorkflowJobInfo]:
        jobs = self.paged(f"/repos/{repository}/actions/runs/{run_id}/jobs", "jobs", background=POLL_SHARE)
        return [WorkflowJobInfo.from_api(j) for j in jobs]

    def workflow_job(self, repository: str, job_id: int) -> WorkflowJobInfo:
        body = self.request("GET", f"/repos/{repository}/actions/jobs/{job_id}", background=POLL_SHARE)
        return WorkflowJobInfo.from_api(dict(body))

    def hook_deliveries(self, *, since: datetime | None, pages: int = 10) -> list[HookDelivery]:
        """The App's deliveries, newest first, back to ``since`` (or ``pages`` pages of 100): GitHub
        pages them by a ``cursor`` its ``Link`` header names (REST docs, *List deliveries for an
        app webhook*), never by page number."""
        found: list[HookDelivery] = []
        params: dict[str, Any] = {"per_page": 100}
        for _ in range(pages):
            answer = self.request("GET", "/app/hook/deliveries", params=params, auth="app", background=True)
            batch = [HookDelivery.from_api(d) for d in answer] if isinstance(answer, list) else []
            found += batch
            cursor = next_cursor(str(self.last_headers.get("Link") or ""))
            older = since is not None and any(d.delivered_at and d.delivered_at < since for d in batch)
            if not batch or cursor is None or older:
                break
            params = {"per_page": 100, "cursor": cursor}
        return found

    def redeliver(self, delivery_id: int) -> None:
        self.request("POST", f"/app/hook/deliveries/{delivery_id}/attempts", auth="app", background=True)

    def windows(self, method: str, path: str) -> list[Window]:
        endpoint = endpoint_of(method, path)
        documented, most = ENDPOINT_POINTS
        found = [
            Window(
                f"points {endpoint}",
                60.0,
                1 if method in ("GET", "HEAD", "OPTIONS") else 5,
                most,
                f"GitHub's secondary limit of {documented} points a minute for {endpoint}",
            )
        ]
        if method == "POST" and CREATING.fullmatch(path):
            (per_minute, most_minute), (per_hour, most_hour) = CREATIONS_PER_MINUTE, CREATIONS_PER_HOUR
            found += [
                Window(
                    "creations a minute",
                    60.0,
                    1,
                    most_minute,
                    f"GitHub's content-creation limit ({per_minute} a minute; a runner registration is one)",
                    creates=True,
                ),
                Window(
                    "creations an hour",
                    3600.0,
                    1,
                    most_hour,
                    f"GitHub's content-creation limit ({per_hour} an hour; a runner registration is one)",
                    creates=True,
                ),
            ]
        return found

    # ---- how GitHub authenticates -----------------------------------------------------------

    def base_url(self) -> str:
        return str(self.connection.api_url)

    def headers(self, auth: str) -> dict[str, str]:
        return {
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": API_VERSION,
            "User-Agent": "catacloud",
            "Authorization": f"Bearer {self._credential(auth)}",
        }

    def refresh_credential(self, auth: str) -> bool:
        if auth == "app":
            return False
        # a revoked or expired installation token: get a fresh one
        installation_token_drop(installation=self.installation)
        return True

    def limit_name(self, *, secondary: bool) -> str:
        return "secondary rate limit" if secondary else "rate limit exhausted"

    def _credential(self, auth: str) -> str:
        secrets = self.connection.secrets
        if auth == "app":
            return app_jwt(self.connection.app_id, secrets.get("private_key", ""))
        return self._token()

    def _token(self) -> str:
        cached = installation_token_cached(installation=self.installation, now=timezone.now())
        if cached is not None:
            return cached
        self._spend(background=False)
        fresh = self.request_raw_app_token()
        inst = self.installation
        installation_token_store(installation=inst, token=fresh.token, expires_at=fresh.expires_at)
        return fresh.token

    def request_raw_app_token(self) -> InstallationToken:
        """``POST /app/installations/{id}/access_tokens`` with the App's JWT (no retry loop of its
        own: the call that needs the token retries)."""
        try:
            response = SESSION.post(
                f"{self.base}/app/installations/{self.installation.installation_id}/access_tokens",
                headers=self.headers("app"),
                timeout=settings.CATACLOUD_GITHUB_TIMEOUT,
            )
        except requests.RequestException as exc:
            self._mark_unavailable(f"installation token: {type(exc).__name__}")
            raise GitHubUnavailable(f"installation token: {type(exc).__name__}") from None
        self._record_limits(response)
        if response.status_code >= 300:
            limited = self.rate_limit(response)
            if limited is not None:
                raise self._limited(limited, "POST /app/installations/{id}/access_tokens")
            detail = f"installation token: HTTP {response.status_code} {message(response)}"
            if response.status_code >= 500:
                self._mark_unavailable(detail)
                raise GitHubUnavailable(detail, response.status_code)
            raise refused(response.status_code, detail)
        return InstallationToken.from_api(response.json())
