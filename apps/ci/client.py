"""The one client machinery every forge call goes through (GitHub's and GitLab's clients are
subclasses that say how to authenticate and where the rate limit is read):

- **Limits**: the forge's remaining calls and reset are recorded after every answer; a
  rate-limited answer (429, or GitHub's 403) with ``Retry-After`` or an exhausted limit makes the
  endpoint unavailable until then, without another call. Our own per-endpoint budget (the
  forge's ``..._REQUEST_BUDGET`` calls per hour) keeps a reserve for dispatch: background calls
  (the reconciler's polls) stop at 80 % of it.
- **Failures**: connection errors, timeouts and 5xx are retried twice with a short backoff;
  then the endpoint is unavailable for a backoff that doubles (15 s up to 5 min) and its queued
  runner jobs are held, so no machine is bought while the forge is down. The first successful
  call afterwards releases them.
- Never logs a token, a key or a body.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, ClassVar

import requests
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.ci.availability import endpoint_available, endpoint_unavailable
from apps.ci.errors import ForgeError, ForgeRateLimited, ForgeRefused, ForgeUnavailable, refused
from apps.ci.forge import Forge

log = logging.getLogger(__name__)


# Reading a forge's JSON leniently (its answers' from_api): a field missing or of the wrong kind
# is None, never an exception that would stop a poll or a reconcile.
def int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def iso_when(value: Any) -> datetime | None:
    """An ISO 8601 timestamp; None when absent or not one (a well-formed 30 February too)."""
    if not isinstance(value, str):
        return None
    try:
        return parse_datetime(value)
    except ValueError:
        return None


RETRIES = 2
RETRY_BACKOFF = (0.2, 0.6)
BACKGROUND_SHARE = 0.8  # background calls stop at this share of the hourly budget
LOW_REMAINING = 50  # the forge's own remaining calls below which background calls wait for the reset

SESSION = requests.Session()  # one connection pool per process, shared by the forges


class ForgeClient:
    """Calls to a forge for one endpoint. Subclasses set ``forge`` and say how a call is
    authenticated (:meth:`headers`) and where the rate limit is read."""

    forge: ClassVar[Forge]
    # The headers of the forge's remaining calls and their reset (epoch seconds).
    remaining_header: ClassVar[str] = "ratelimit-remaining"
    reset_header: ClassVar[str] = "ratelimit-reset"
    # The statuses a rate limit may answer with (GitHub also limits with 403).
    limit_statuses: ClassVar[tuple[int, ...]] = (429,)

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.base = self.base_url().rstrip("/")
        # Called before every call (the reconciler renews its claim on the endpoint there).
        self.before_call: Callable[[], object] | None = None

    # ---- what a forge's client says -----------------------------------------------------------

    def base_url(self) -> str:
        raise NotImplementedError

    def headers(self, auth: str) -> dict[str, str]:
        """The headers of one call, its credential included."""
        raise NotImplementedError

    def refresh_credential(self, auth: str) -> bool:
        """A 401: drop a cached credential and say whether a fresh one is worth a second try."""
        return False

    # ---- the machinery ----------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        auth: str = "default",
        background: bool = False,
    ) -> Any:
        """One call, with the limits, retries and availability rules above. Returns the
        decoded JSON body (None for 204)."""
        if self.before_call is not None:
            self.before_call()
        self._check_available()
        self._spend(background=background)
        attempt = 0
        refreshed = False
        while True:
            headers = self.headers(auth)
            try:
                response = SESSION.request(
                    method,
                    self.base + path,
                    json=json,
                    params=params,
                    headers=headers,
                    timeout=getattr(settings, self.forge.settings.timeout),
                )
            except requests.RequestException as exc:
                failure: ForgeError = ForgeUnavailable(f"{method} {path}: {type(exc).__name__}")
            else:
                self._record_limits(response)
                status = response.status_code
                if status < 300:
                    self._succeeded()
                    return response.json() if response.content else None
                limited = self.rate_limit(response)
                if limited is not None:
                    self._mark_unavailable(str(limited), seconds=limited.retry_after)
                    raise limited
                if status == 401 and not refreshed and self.refresh_credential(auth):
                    refreshed = True  # a revoked or expired token: a fresh one, once
                    continue
                detail = f"{method} {path}: HTTP {status} {message(response)}"
                if status < 500:
                    raise refused(status, detail)
                failure = ForgeUnavailable(detail, status)
            if attempt >= RETRIES:
                self._mark_unavailable(failure.detail)
                raise failure
            time.sleep(RETRY_BACKOFF[attempt])
            attempt += 1
            self._spend(background=background)

    def _check_available(self) -> None:
        model = self.forge.endpoint
        row = (
            model.objects.filter(pk=self.endpoint.pk)
            .values("unavailable_until", "unavailable_reason", "failures")
            .first()
        )
        if row is None:
            raise ForgeRefused(f"this {self.forge.title} endpoint is no longer connected")
        self.endpoint.failures = row["failures"]
        self.endpoint.unavailable_until = row["unavailable_until"]
        if row["unavailable_until"] and row["unavailable_until"] > timezone.now():
            wait = (row["unavailable_until"] - timezone.now()).total_seconds()
            raise ForgeRateLimited(
                f"{self.forge.title} unavailable: {row['unavailable_reason']}", retry_after=wait
            )

    def _spend(self, *, background: bool) -> None:
        """Count one call against the endpoint's hourly budget (and in ``calls_total``); refuse
        it when the budget (for background calls: its 80 %) is used up."""
        budget = getattr(settings, self.forge.settings.request_budget)
        now = timezone.now()
        model = self.forge.endpoint
        with transaction.atomic():
            row = (
                model.objects.select_for_update(no_key=True)
                .only("window_started_at", "window_calls", "calls_total", "rate_remaining", "rate_reset_at")
                .get(pk=self.endpoint.pk)
            )
            if row.window_started_at is None or now - row.window_started_at >= timedelta(hours=1):
                row.window_started_at, row.window_calls = now, 0
            limit = budget * BACKGROUND_SHARE if background else budget
            window_end = row.window_started_at + timedelta(hours=1)
            if row.window_calls >= limit:
                raise ForgeRateLimited(
                    f"request budget used: {row.window_calls}/{budget} calls this hour",
                    retry_after=(window_end - now).total_seconds(),
                )
            if (
                background
                and row.rate_remaining is not None
                and row.rate_remaining < LOW_REMAINING
                and row.rate_reset_at is not None
                and row.rate_reset_at > now
            ):
                raise ForgeRateLimited(
                    f"{self.forge.title} rate limit nearly used ({row.rate_remaining} left): "
                    "background calls wait",
                    retry_after=(row.rate_reset_at - now).total_seconds(),
                )
            model.objects.filter(pk=row.pk).update(
                window_started_at=row.window_started_at,
                window_calls=row.window_calls + 1,
                calls_total=row.calls_total + 1,
            )

    def _record_limits(self, response: requests.Response) -> None:
        remaining = response.headers.get(self.remaining_header)
        reset = response.headers.get(self.reset_header)
        if remaining is None or reset is None:
            return
        try:
            values = {
                "rate_remaining": int(remaining),
                "rate_reset_at": datetime.fromtimestamp(int(reset), tz=timezone.get_current_timezone()),
            }
        except ValueError:
            return
        self.forge.endpoint.objects.filter(pk=self.endpoint.pk).update(**values)

    def rate_limit(self, response: requests.Response) -> ForgeRateLimited | None:
        """A rate-limited answer: ``Retry-After`` (GitHub's secondary limits, GitLab's 429),
        else an exhausted limit (remaining 0: wait for the reset), else a 429 (60 s)."""
        if response.status_code not in self.limit_statuses:
            return None
        retry_after = response.headers.get("retry-after")
        if retry_after is not None:
            try:
                wait = max(1.0, float(retry_after))
            except ValueError:
                wait = 60.0
            return ForgeRateLimited(
                f"{self.limit_name(secondary=True)} (retry after {wait:.0f}s)", wait, response.status_code
            )
        if response.headers.get(self.remaining_header) == "0":
            try:
                wait = max(1.0, int(response.headers.get(self.reset_header, "0")) - time.time())
            except ValueError:
                wait = 60.0
            return ForgeRateLimited(
                f"{self.limit_name(secondary=False)} (resets in {wait:.0f}s)", wait, response.status_code
            )
        if response.status_code == 429:
            return ForgeRateLimited("rate limited (429)", 60.0, 429)
        return None

    def limit_name(self, *, secondary: bool) -> str:
        return "rate limited" if secondary else "rate limit exhausted"

    def _mark_unavailable(self, reason: str, seconds: float | None = None) -> None:
        endpoint_unavailable(forge=self.forge, endpoint_id=self.endpoint.pk, reason=reason, seconds=seconds)

    def _succeeded(self) -> None:
        if self.endpoint.failures or self.endpoint.unavailable_until:
            endpoint_available(forge=self.forge, endpoint_id=self.endpoint.pk)
            self.endpoint.failures = 0
            self.endpoint.unavailable_until = None

    def paged(
        self, path: str, key: str | None, *, params: dict[str, Any] | None = None, background: bool
    ) -> list[dict[str, Any]]:
        """Every page (up to 10 of 100) of a list: the answer's ``key`` (GitHub wraps lists in an
        object), or the answer itself (GitLab answers a list)."""
        items: list[dict[str, Any]] = []
        page = 1
        while True:
            body = self.request(
                "GET", path, params={**(params or {}), "per_page": 100, "page": page}, background=background
            )
            if key is None:
                batch = body if isinstance(body, list) else []
            else:
                batch = body.get(key, []) if isinstance(body, dict) else []
            items.extend(batch)
            if len(batch) < 100 or page >= 10:
                return items
            page += 1


def message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    return str(body.get("message") or body.get("error") or "")[:300]
