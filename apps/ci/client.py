"""The one client machinery every forge call goes through (GitHub's and GitLab's clients are
subclasses that say how to authenticate and where the rate limit is read):

- **Limits as back pressure**: the forge's remaining calls and reset are recorded after every
  answer. Every limit answer (429, or GitHub's 403 that says a rate limit; with ``Retry-After``,
  with an exhausted limit, or with neither) makes the endpoint wait without another call: the
  reset, the ``Retry-After``, or (a secondary limit saying neither) the forge's documented
  minimum (GitHub: a minute), doubled while answers stay limited (up to 15 minutes). Its runner
  jobs are held meanwhile with a pending reason naming the limit; each answer is counted
  (``limited_total``, a metric) and recorded (``<forge>.rate_limited``).
- **Our own budget, sized from the forge's documented limits**: calls per hour per endpoint
  (``..._REQUEST_BUDGET``; the reconciler's runner upkeep stops at 80 % of it and its polls at
  50 %, so dispatch always has the rest), and the forge's per-minute and per-hour windows
  (:meth:`ForgeClient.windows`: GitHub's points per endpoint and content creation), kept below
  the documented figure so the forge never has to refuse. A call over a window is not made: a
  registration then waits (the endpoint is *paced*: its runner jobs are held until the window
  turns), anything else stops until the next pass.
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
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar

import requests
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.ci.availability import endpoint_available, endpoint_limited, endpoint_paced, endpoint_unavailable
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
BACKGROUND_SHARE = 0.8  # background calls (the reconciler's runner upkeep) stop at this share
POLL_SHARE = 0.5  # the reconciler's polls for missed jobs stop at this share of the hourly budget
LOW_REMAINING = 50  # the forge's own remaining calls below which background calls wait for the reset
LONGEST_LIMIT_WAIT = 900.0  # a repeated secondary limit waits at most this long
NO_WAIT_NAMED = 60.0  # a limit answer naming no wait (no Retry-After, no reset): at least this
SECONDARY_STREAK = "secondary streak"  # spend's entry: [last answer (epoch s), streak, kept for s]


@dataclass(frozen=True)
class Window:
    """One of the forge's documented per-window limits, as our pacing keeps it: at most ``most``
    (below the documented figure) per ``seconds``, a call costing ``cost``; ``what`` names it in
    reasons ("GitHub's content-creation limit (500 an hour)")."""

    key: str
    seconds: float
    cost: int
    most: int
    what: str
    creates: bool = False  # a content-creating call's window (a runner registration's)


def time_scale() -> float:
    """Documented windows and waits are divided by this (``CATACLOUD_CI_LIMIT_TIME_SCALE``: 1,
    except in simulations against the fakes, whose clock runs as many times faster)."""
    return float(getattr(settings, "CATACLOUD_CI_LIMIT_TIME_SCALE", 1.0) or 1.0)


def _seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(1.0, float(value))
    except ValueError:
        return None


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
    # Words of a limit answer's message (a 403 saying none of them is a refusal).
    limit_words: ClassVar[tuple[str, ...]] = ("rate limit",)
    # A secondary limit's documented shortest wait, even with a shorter Retry-After (GitHub: a
    # minute); 0: a Retry-After is honoured as it is (GitLab).
    secondary_minimum: ClassVar[float] = 0.0

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.base = self.base_url().rstrip("/")
        # Called before every call (the reconciler renews its claim on the endpoint there).
        self.before_call: Callable[[], object] | None = None
        self.last_headers: Any = {}  # the last successful answer's headers (a Link to page on)

    # ---- what a forge's client says -----------------------------------------------------------

    def base_url(self) -> str:
        raise NotImplementedError

    def headers(self, auth: str) -> dict[str, str]:
        """The headers of one call, its credential included."""
        raise NotImplementedError

    def refresh_credential(self, auth: str) -> bool:
        """A 401: drop a cached credential and say whether a fresh one is worth a second try."""
        return False

    def windows(self, method: str, path: str) -> list[Window]:
        """The forge's documented per-window limits this call counts against (none by default)."""
        return []

    # ---- the machinery ----------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        auth: str = "default",
        background: bool | float = False,
    ) -> Any:
        """One call, with the limits, retries and availability rules above. Returns the
        decoded JSON body (None for 204). ``background``: True (or a share of the hourly
        budget, :data:`POLL_SHARE`) for the reconciler's calls, which yield to dispatch."""
        if self.before_call is not None:
            self.before_call()
        windows = self.windows(method, path)
        self._spend(background=background, windows=windows, check_available=True)
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
                    self.last_headers = response.headers
                    return response.json() if response.content else None
                limited = self.rate_limit(response)
                if limited is not None:
                    creates = any(w.creates for w in windows)
                    raise self._limited(limited, f"{method} {path}", creates=creates)
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
            self._spend(background=background, windows=windows)

    def _check_available(self, row: Any) -> None:
        """Refuse the call (made not) while the endpoint is paused; learn its failure count."""
        self.endpoint.failures = row.failures
        self.endpoint.unavailable_until = row.unavailable_until
        if row.unavailable_until and row.unavailable_until > timezone.now():
            wait = (row.unavailable_until - timezone.now()).total_seconds()
            raise ForgeRateLimited(
                f"{self.forge.title} unavailable: {row.unavailable_reason}", retry_after=wait
            )

    def _spend(
        self, *, background: bool | float, windows: list[Window] | None = None, check_available: bool = False
    ) -> None:
        """Count one call against the endpoint's hourly budget (and in ``calls_total``) and its
        documented windows; refuse it (made not) when the budget (for background calls: their
        share) or a window is used up, or (``check_available``: a call's first try) while the
        endpoint is paused. One locked read of the endpoint's row for all of it."""
        budget = getattr(settings, self.forge.settings.request_budget)
        share = (
            1.0 if background is False else (BACKGROUND_SHARE if background is True else float(background))
        )
        now = timezone.now()
        model = self.forge.endpoint
        with transaction.atomic():
            row = (
                model.objects.select_for_update(no_key=True)
                .only(
                    "window_started_at",
                    "window_calls",
                    "calls_total",
                    "rate_remaining",
                    "rate_reset_at",
                    "spend",
                    "paced_until",
                    "paced_reason",
                    "unavailable_until",
                    "unavailable_reason",
                    "failures",
                )
                .filter(pk=self.endpoint.pk)
                .first()
            )
            if row is None:
                raise ForgeRefused(f"this {self.forge.title} endpoint is no longer connected")
            if check_available:
                self._check_available(row)
            if windows and any(w.creates for w in windows) and row.is_paced(now):
                raise ForgeRateLimited(  # registrations wait (a creation limit): no call
                    row.paced_reason or "registrations paced",
                    retry_after=(row.paced_until - now).total_seconds(),
                    paced=True,
                )
            if row.window_started_at is None or now - row.window_started_at >= timedelta(hours=1):
                row.window_started_at, row.window_calls = now, 0
            window_end = row.window_started_at + timedelta(hours=1)
            if row.window_calls >= budget * share:
                raise ForgeRateLimited(
                    f"request budget used: {row.window_calls}/{budget} calls this hour"
                    + (f" ({share:.0%} for background calls)" if share < 1 else ""),
                    retry_after=(window_end - now).total_seconds(),
                    paced=True,
                )
            if (
                share < 1
                and row.rate_remaining is not None
                and row.rate_remaining < LOW_REMAINING
                and row.rate_reset_at is not None
                and row.rate_reset_at > now
            ):
                raise ForgeRateLimited(
                    f"{self.forge.title} rate limit nearly used ({row.rate_remaining} left): "
                    "background calls wait",
                    retry_after=(row.rate_reset_at - now).total_seconds(),
                    paced=True,
                )
            spend = self._windows_spent(row.spend or {}, windows or [], now.timestamp())
            model.objects.filter(pk=row.pk).update(
                window_started_at=row.window_started_at,
                window_calls=row.window_calls + 1,
                calls_total=row.calls_total + 1,
                spend=spend,
            )

    def _windows_spent(self, spend: dict[str, Any], windows: list[Window], now: float) -> dict[str, Any]:
        """``spend`` with this call counted in each of ``windows`` (expired windows dropped), or
        :class:`ForgeRateLimited` (paced) naming the first window it would overrun."""
        scale = time_scale()
        fresh = {k: v for k, v in spend.items() if isinstance(v, list) and now - v[0] < v[2]}
        for window in windows:
            seconds = window.seconds / scale
            start, used, _ = fresh.get(window.key, [now, 0, seconds])
            if used + window.cost > window.most:
                wait = start + seconds - now
                raise ForgeRateLimited(
                    f"{window.what}: {used}/{window.most} this window, next in {wait:.0f}s",
                    retry_after=max(0.5, wait),
                    paced=True,
                )
            fresh[window.key] = [start, used + window.cost, seconds]
        return fresh

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
        """A limit answer, else None (a 403 that names no limit is a refusal). In the order the
        forge's documentation gives (GitHub's "Exceeding the rate limit"): ``Retry-After``; an
        exhausted limit (remaining 0: wait for its reset); else a secondary limit that names no
        wait: the documented shortest one (a minute), longer when repeated."""
        status = response.status_code
        if status not in self.limit_statuses:
            return None
        said = message(response).lower()
        named = status == 429 or any(word in said for word in self.limit_words)
        retry_after = _seconds(response.headers.get("retry-after"))
        if retry_after is not None and named:
            return ForgeRateLimited(
                f"{self.limit_name(secondary=True)} (HTTP {status}, retry-after {retry_after:.0f}s)",
                retry_after,
                status,
                secondary=self.secondary_minimum > 0,
            )
        if response.headers.get(self.remaining_header) == "0":
            try:
                wait = max(1.0, int(response.headers.get(self.reset_header, "0")) - time.time())
            except ValueError:
                wait = 60.0
            return ForgeRateLimited(
                f"{self.limit_name(secondary=False)} (resets in {wait:.0f}s)", wait, status
            )
        if named:
            return ForgeRateLimited(
                f"{self.limit_name(secondary=True)} (HTTP {status}, no retry-after)",
                (self.secondary_minimum or NO_WAIT_NAMED) / time_scale(),
                status,
                secondary=True,
            )
        return None

    def _limited(self, limited: ForgeRateLimited, call: str, *, creates: bool = False) -> ForgeRateLimited:
        """A limit answer: the endpoint waits (a secondary limit at least the documented minimum,
        doubled for each limited answer in a row, at most 15 minutes), and it is counted. A
        secondary limit answering a content-creating call (a runner registration: the creation
        limits are GitHub's per-window count of those) holds the registrations only, as our own
        pacing does, so the reconciler's other calls go on; any other limit answer makes the
        whole endpoint wait."""
        if limited.secondary:
            minimum = (self.secondary_minimum or NO_WAIT_NAMED) / time_scale()
            streak = self._secondary_streak(minimum)
            longest = LONGEST_LIMIT_WAIT / time_scale()
            limited.retry_after = max(limited.retry_after, min(longest, minimum * 2**streak))
            self._secondary_answered(streak, limited.retry_after + minimum)
            limited.detail = f"{limited.detail}: waiting {limited.retry_after:.0f}s"
            limited.args = (limited.detail,)
        self.forge.endpoint.objects.filter(pk=self.endpoint.pk).update(limited_total=F("limited_total") + 1)
        if limited.secondary and creates:
            endpoint_paced(
                forge=self.forge,
                endpoint_id=self.endpoint.pk,
                reason=str(limited),
                seconds=limited.retry_after,
            )
            limited.paced = True
        else:
            self._mark_unavailable(str(limited), seconds=limited.retry_after)
        endpoint_limited(forge=self.forge, endpoint_id=self.endpoint.pk, limited=limited, call=call)
        return limited

    def _secondary_streak(self, minimum: float) -> int:
        """Secondary-limit answers in a row before this one (0: the first): an answer counts in a
        row when it comes within its predecessor's wait and a minimum more, whatever other calls
        succeeded between (GitHub: "wait for an exponentially increasing amount of time between
        retries" while the request keeps failing)."""
        spend = (
            self.forge.endpoint.objects.filter(pk=self.endpoint.pk).values_list("spend", flat=True).first()
        )
        last = (spend or {}).get(SECONDARY_STREAK)
        now = time.time()
        if isinstance(last, list) and len(last) == 3 and now - float(last[0]) < float(last[2]):
            return min(6, int(last[1]) + 1)
        return 0

    def _secondary_answered(self, streak: int, remembered: float) -> None:
        """Remember this answer's place in its streak for ``remembered`` seconds (a spend entry,
        which expires as the windows' do)."""
        model = self.forge.endpoint
        with transaction.atomic():
            row = model.objects.select_for_update(no_key=True).only("spend").get(pk=self.endpoint.pk)
            spend = dict(row.spend or {})
            spend[SECONDARY_STREAK] = [time.time(), streak, remembered]
            model.objects.filter(pk=row.pk).update(spend=spend)

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
        self, path: str, key: str | None, *, params: dict[str, Any] | None = None, background: bool | float
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
