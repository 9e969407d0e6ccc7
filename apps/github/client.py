"""The one GitHub client: every call Catacloud makes to GitHub goes through :class:`GitHubClient`.

- **Auth**: the App's JWT (RS256, signed by PyJWT with ``cryptography``'s RSA: no hand-rolled
  crypto) for App endpoints, and installation tokens for the rest, cached encrypted on the
  installation row (shared by every process) until 5 minutes before they expire.
- **Limits**: ``x-ratelimit-remaining`` / ``x-ratelimit-reset`` are recorded after every
  answer; a 403/429 with ``Retry-After`` (secondary limits) or an exhausted primary limit makes
  the installation unavailable until then, without another call. Our own per-installation
  budget (``CATACLOUD_GITHUB_REQUEST_BUDGET`` calls per hour) keeps a reserve for dispatch:
  background calls (the reconciler's polls) stop at 80 % of it.
- **Failures**: connection errors, timeouts and 5xx are retried twice with a short backoff;
  then the installation is unavailable for a backoff that doubles (15 s up to 5 min) and its
  queued runner jobs are held, so no machine is bought while GitHub is down. The first
  successful call afterwards releases them.
- Never logs a token, a key or a body.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import jwt
import requests
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.core.crypto import encrypt_json
from apps.github.availability import installation_available, installation_unavailable
from apps.github.models import GitHubInstallation

log = logging.getLogger(__name__)

API_VERSION = "2022-11-28"
TOKEN_MARGIN = timedelta(minutes=5)  # refresh an installation token this long before it expires
RETRIES = 2
RETRY_BACKOFF = (0.2, 0.6)
BACKGROUND_SHARE = 0.8  # background calls stop at this share of the hourly budget
LOW_REMAINING = 50  # GitHub's own remaining calls below which background calls wait for the reset


class GitHubError(Exception):
    """A GitHub call failed. ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, detail: str, status: int = 0) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


class GitHubUnavailable(GitHubError):
    """GitHub did not answer usefully (connection, timeout, 5xx), or is known to be down."""


class GitHubRateLimited(GitHubError):
    """A rate limit (GitHub's, or our own budget): wait ``retry_after`` seconds."""

    def __init__(self, detail: str, retry_after: float, status: int = 0) -> None:
        super().__init__(detail, status)
        self.retry_after = retry_after


class GitHubRefused(GitHubError):
    """A 4xx answer: the request is wrong for GitHub (configuration, permissions, state)."""


class GitHubNotFound(GitHubRefused):
    pass


class GitHubConflict(GitHubRefused):
    """409: e.g. a runner with this name exists already."""


class GitHubUnprocessable(GitHubRefused):
    """422: e.g. a busy runner cannot be deleted; no runner group given."""


def app_jwt(app_id: int, private_key: str, now: float | None = None) -> str:
    """The App's JSON Web Token: RS256, issued 60 s in the past (clock drift), valid 9 minutes
    (GitHub accepts at most 10)."""
    issued = int(now if now is not None else time.time()) - 60
    return jwt.encode({"iat": issued, "exp": issued + 600 - 60, "iss": str(app_id)}, private_key, "RS256")


@dataclass(frozen=True)
class JitRunner:
    runner_id: int
    name: str
    encoded_jit_config: str  # the secret: never logged, never returned by our API

    def __repr__(self) -> str:  # a stray log line must not print the config
        return f"JitRunner(runner_id={self.runner_id}, name={self.name!r})"


_session = requests.Session()


class GitHubClient:
    """Calls to GitHub for one installation (and its connection's App)."""

    def __init__(self, installation: GitHubInstallation) -> None:
        self.installation = installation
        self.connection = installation.connection
        self.base = self.connection.api_url.rstrip("/")

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
        return JitRunner(
            int(body["runner"]["id"]), str(body["runner"]["name"]), str(body["encoded_jit_config"])
        )

    def list_runners(self, *, owner_path: str, background: bool = True) -> list[dict[str, Any]]:
        return self._paged(f"{owner_path}/actions/runners", "runners", background=background)

    def runner_by_name(self, *, owner_path: str, name: str) -> dict[str, Any] | None:
        body = self.request("GET", f"{owner_path}/actions/runners", params={"name": name, "per_page": 100})
        return next((r for r in body.get("runners", []) if r.get("name") == name), None)

    def delete_runner(self, *, owner_path: str, runner_id: int, background: bool = False) -> bool:
        """Delete a registered runner; False when it was already gone (404). A busy runner:
        :class:`GitHubUnprocessable` (GitHub refuses while it runs a job)."""
        try:
            self.request("DELETE", f"{owner_path}/actions/runners/{runner_id}", background=background)
        except GitHubNotFound:
            return False
        return True

    def repositories(self) -> list[dict[str, Any]]:
        return self._paged("/installation/repositories", "repositories", background=True)

    def queued_runs(self, repository: str) -> list[dict[str, Any]]:
        return self._paged(
            f"/repos/{repository}/actions/runs", "workflow_runs", params={"status": "queued"}, background=True
        )

    def run_jobs(self, repository: str, run_id: int) -> list[dict[str, Any]]:
        return self._paged(f"/repos/{repository}/actions/runs/{run_id}/jobs", "jobs", background=True)

    def workflow_job(self, repository: str, job_id: int) -> dict[str, Any]:
        return self.request("GET", f"/repos/{repository}/actions/jobs/{job_id}", background=True)

    def hook_deliveries(self) -> list[dict[str, Any]]:
        answer = self.request(
            "GET", "/app/hook/deliveries", params={"per_page": 100}, auth="app", background=True
        )
        return answer if isinstance(answer, list) else []

    def redeliver(self, delivery_id: int) -> None:
        self.request("POST", f"/app/hook/deliveries/{delivery_id}/attempts", auth="app", background=True)

    # ---- the machinery ----------------------------------------------------------------------

    def _paged(
        self, path: str, key: str, *, params: dict[str, Any] | None = None, background: bool
    ) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        page = 1
        while True:
            body = self.request(
                "GET", path, params={**(params or {}), "per_page": 100, "page": page}, background=background
            )
            batch = body.get(key, []) if isinstance(body, dict) else []
            items.extend(batch)
            if len(batch) < 100 or page >= 10:
                return items
            page += 1

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        auth: str = "installation",
        background: bool = False,
    ) -> Any:
        """One call, with the limits, retries and availability rules above. Returns the
        decoded JSON body (None for 204)."""
        self._check_available()
        self._spend(background=background)
        attempt = 0
        refreshed = False
        while True:
            headers = {
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": API_VERSION,
                "User-Agent": "catacloud",
                "Authorization": f"Bearer {self._credential(auth)}",
            }
            try:
                response = _session.request(
                    method,
                    self.base + path,
                    json=json,
                    params=params,
                    headers=headers,
                    timeout=settings.CATACLOUD_GITHUB_TIMEOUT,
                )
            except requests.RequestException as exc:
                failure: GitHubError = GitHubUnavailable(f"{method} {path}: {type(exc).__name__}")
            else:
                self._record_limits(response)
                status = response.status_code
                if status < 300:
                    self._succeeded()
                    return response.json() if response.content else None
                limited = self._rate_limit(response)
                if limited is not None:
                    self._mark_unavailable(str(limited), seconds=limited.retry_after)
                    raise limited
                if status == 401 and auth == "installation" and not refreshed:
                    refreshed = True  # a revoked or expired token: get a fresh one, once
                    self._drop_token()
                    continue
                detail = f"{method} {path}: HTTP {status} {_message(response)}"
                if status < 500:
                    raise _refused(status, detail)
                failure = GitHubUnavailable(detail, status)
            if attempt >= RETRIES:
                self._mark_unavailable(failure.detail)
                raise failure
            time.sleep(RETRY_BACKOFF[attempt])
            attempt += 1
            self._spend(background=background)

    def _credential(self, auth: str) -> str:
        secrets = self.connection.secrets
        if auth == "app":
            return app_jwt(self.connection.app_id, secrets.get("private_key", ""))
        return self._token()

    def _token(self) -> str:
        inst = self.installation
        now = timezone.now()
        if inst.token_encrypted and inst.token_expires_at and inst.token_expires_at - TOKEN_MARGIN > now:
            return inst.token
        fresh = (
            GitHubInstallation.objects.filter(pk=inst.pk)
            .values("token_encrypted", "token_expires_at")
            .first()
        )
        if (
            fresh
            and fresh["token_encrypted"]
            and fresh["token_expires_at"]
            and fresh["token_expires_at"] - TOKEN_MARGIN > now
        ):
            inst.token_encrypted, inst.token_expires_at = fresh["token_encrypted"], fresh["token_expires_at"]
            return inst.token
        self._spend(background=False)
        body = self.request_raw_app_token()
        expires = datetime.fromisoformat(str(body["expires_at"]).replace("Z", "+00:00"))
        inst.token_encrypted = encrypt_json({"token": body["token"]})
        inst.token_expires_at = expires
        GitHubInstallation.objects.filter(pk=inst.pk).update(
            token_encrypted=inst.token_encrypted, token_expires_at=expires
        )
        return str(body["token"])

    def request_raw_app_token(self) -> dict[str, Any]:
        """``POST /app/installations/{id}/access_tokens`` with the App's JWT (no retry loop of its
        own: the call that needs the token retries)."""
        try:
            response = _session.post(
                f"{self.base}/app/installations/{self.installation.installation_id}/access_tokens",
                headers={
                    "Accept": "application/vnd.github+json",
                    "X-GitHub-Api-Version": API_VERSION,
                    "User-Agent": "catacloud",
                    "Authorization": f"Bearer {self._credential('app')}",
                },
                timeout=settings.CATACLOUD_GITHUB_TIMEOUT,
            )
        except requests.RequestException as exc:
            self._mark_unavailable(f"installation token: {type(exc).__name__}")
            raise GitHubUnavailable(f"installation token: {type(exc).__name__}") from None
        self._record_limits(response)
        if response.status_code >= 300:
            limited = self._rate_limit(response)
            if limited is not None:
                self._mark_unavailable(str(limited), seconds=limited.retry_after)
                raise limited
            detail = f"installation token: HTTP {response.status_code} {_message(response)}"
            if response.status_code >= 500:
                self._mark_unavailable(detail)
                raise GitHubUnavailable(detail, response.status_code)
            raise _refused(response.status_code, detail)
        return dict(response.json())

    def _drop_token(self) -> None:
        self.installation.token_encrypted = ""
        self.installation.token_expires_at = None
        GitHubInstallation.objects.filter(pk=self.installation.pk).update(
            token_encrypted="", token_expires_at=None
        )

    def _check_available(self) -> None:
        row = (
            GitHubInstallation.objects.filter(pk=self.installation.pk)
            .values("unavailable_until", "unavailable_reason", "failures")
            .first()
        )
        if row is None:
            raise GitHubRefused("this installation is no longer connected")
        self.installation.failures = row["failures"]
        self.installation.unavailable_until = row["unavailable_until"]
        if row["unavailable_until"] and row["unavailable_until"] > timezone.now():
            wait = (row["unavailable_until"] - timezone.now()).total_seconds()
            raise GitHubRateLimited(f"GitHub unavailable: {row['unavailable_reason']}", retry_after=wait)

    def _spend(self, *, background: bool) -> None:
        """Count one call against the installation's hourly budget (and in ``calls_total``);
        refuse it when the budget (for background calls: its 80 %) is used up."""
        budget = settings.CATACLOUD_GITHUB_REQUEST_BUDGET
        now = timezone.now()
        with transaction.atomic():
            inst = (
                GitHubInstallation.objects.select_for_update(no_key=True)
                .only("window_started_at", "window_calls", "calls_total", "rate_remaining", "rate_reset_at")
                .get(pk=self.installation.pk)
            )
            if inst.window_started_at is None or now - inst.window_started_at >= timedelta(hours=1):
                inst.window_started_at, inst.window_calls = now, 0
            limit = budget * BACKGROUND_SHARE if background else budget
            window_end = inst.window_started_at + timedelta(hours=1)
            if inst.window_calls >= limit:
                raise GitHubRateLimited(
                    f"request budget used: {inst.window_calls}/{budget} calls this hour",
                    retry_after=(window_end - now).total_seconds(),
                )
            if (
                background
                and inst.rate_remaining is not None
                and inst.rate_remaining < LOW_REMAINING
                and inst.rate_reset_at is not None
                and inst.rate_reset_at > now
            ):
                raise GitHubRateLimited(
                    f"GitHub rate limit nearly used ({inst.rate_remaining} left): background calls wait",
                    retry_after=(inst.rate_reset_at - now).total_seconds(),
                )
            GitHubInstallation.objects.filter(pk=inst.pk).update(
                window_started_at=inst.window_started_at,
                window_calls=inst.window_calls + 1,
                calls_total=inst.calls_total + 1,
            )

    def _record_limits(self, response: requests.Response) -> None:
        remaining = response.headers.get("x-ratelimit-remaining")
        reset = response.headers.get("x-ratelimit-reset")
        if remaining is None or reset is None:
            return
        try:
            values = {
                "rate_remaining": int(remaining),
                "rate_reset_at": datetime.fromtimestamp(int(reset), tz=timezone.get_current_timezone()),
            }
        except ValueError:
            return
        GitHubInstallation.objects.filter(pk=self.installation.pk).update(**values)

    def _rate_limit(self, response: requests.Response) -> GitHubRateLimited | None:
        """A 403/429 that is a rate limit (primary: remaining 0; secondary: Retry-After)."""
        if response.status_code not in (403, 429):
            return None
        retry_after = response.headers.get("retry-after")
        if retry_after is not None:
            try:
                wait = max(1.0, float(retry_after))
            except ValueError:
                wait = 60.0
            return GitHubRateLimited(
                f"secondary rate limit (retry after {wait:.0f}s)", wait, response.status_code
            )
        if response.headers.get("x-ratelimit-remaining") == "0":
            try:
                wait = max(1.0, int(response.headers.get("x-ratelimit-reset", "0")) - time.time())
            except ValueError:
                wait = 60.0
            return GitHubRateLimited(
                f"rate limit exhausted (resets in {wait:.0f}s)", wait, response.status_code
            )
        if response.status_code == 429:
            return GitHubRateLimited("rate limited (429)", 60.0, 429)
        return None

    def _mark_unavailable(self, reason: str, seconds: float | None = None) -> None:
        installation_unavailable(installation_id=self.installation.pk, reason=reason, seconds=seconds)

    def _succeeded(self) -> None:
        if self.installation.failures or self.installation.unavailable_until:
            installation_available(installation_id=self.installation.pk)
            self.installation.failures = 0
            self.installation.unavailable_until = None


def _message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get("message", ""))[:300] if isinstance(body, dict) else ""


def _refused(status: int, detail: str) -> GitHubRefused:
    kind = {404: GitHubNotFound, 409: GitHubConflict, 422: GitHubUnprocessable}.get(status, GitHubRefused)
    return kind(detail, status)
