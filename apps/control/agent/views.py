"""The Agent API's two hot endpoints as async Django views: the heartbeat (one statement) and
the long poll for work (waits on a Redis wake-up, holding no thread and no database connection).

They span machines (the instance, its heartbeat) and jobs (its assignment, its cancellations),
so they live in the top app. The other agent endpoints stay the apps' DRF views; the agent
server runs them on its database threads (:func:`apps.control.urls.on_db_threads`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from apps.control.agent import db, wakeups
from apps.core.crypto import hash_token
from apps.core.errors import error_payload
from apps.jobs.agent import POLL_KEY, WAKE_KEY, _payload
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.machines.agent_api import AGENT_TOKEN_PREFIX, AgentRateThrottle, instance_heartbeat
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.models import MachineInstance

LIVE = sorted(INSTANCE_LIVE)


def _error(status: int, code: str, detail: str, **headers: str) -> JsonResponse:
    response = JsonResponse(error_payload(code, detail), status=status)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _unauthenticated(code: str, detail: str) -> JsonResponse:
    return _error(401, code, detail, WWW_Authenticate="Agent")


class _TokenThrottle(AgentRateThrottle):
    """``CATACLOUD_AGENT_RATE`` counted per agent token before any database work."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.token_key = key

    def get_cache_key(self, request: Any, view: Any) -> str:
        return f"throttle_agent_t{self.token_key[:32]}"


def _token_hash(request: HttpRequest) -> str | JsonResponse:
    """The agent token's hash, or the 401/429 answer (same codes as the DRF agent views)."""
    parts = request.headers.get("Authorization", "").split()
    if not parts or parts[0] != "Agent":
        return _unauthenticated("not_authenticated", "Authentication credentials were not provided.")
    if len(parts) != 2 or not parts[1].startswith(f"{AGENT_TOKEN_PREFIX}_"):
        return _unauthenticated("authentication_failed", "invalid agent token")
    digest = hash_token(parts[1])
    throttle = _TokenThrottle(digest)
    if not throttle.allow_request(request, None):  # type: ignore[arg-type]  # a key, no DRF view
        wait = throttle.wait()
        retry = str(math.ceil(wait)) if wait else "1"
        return _error(429, "throttled", "Request was throttled.", Retry_After=retry)
    return digest


def _gone() -> JsonResponse:
    return _unauthenticated("authentication_failed", "unknown agent token, or the machine has ended")


# ---- heartbeat ---------------------------------------------------------------------------------

# One statement: authenticate, record the heartbeat and read the jobs to kill. Autocommit, no
# lock taken beyond the row's own UPDATE, so it never waits behind a long poll (which holds none).
HEARTBEAT_SQL = """
UPDATE {instances} AS m SET last_heartbeat_at = %s
WHERE m.agent_token_hash = %s AND m.agent_token_hash <> '' AND m.status = ANY(%s)
RETURNING m.id, m.status, ARRAY(
    SELECT j.id FROM {jobs} AS j
    WHERE j.instance_id = m.id AND j.cancel_requested AND j.status = ANY(%s) ORDER BY j.id
)
"""


def _heartbeat(digest: str) -> tuple[uuid.UUID, str, list[str]] | None:
    sql = HEARTBEAT_SQL.format(instances=MachineInstance._meta.db_table, jobs=Job._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(sql, [timezone.now(), digest, LIVE, [JobStatus.ASSIGNED, JobStatus.RUNNING]])
        row = cursor.fetchone()
    if row is None:
        return None
    instance_id, status, cancel = row
    if status == InstanceStatus.WARMING:  # the handshake: once per machine, the usual service path
        instance = MachineInstance.objects.filter(pk=instance_id).first()
        if instance is not None and instance_heartbeat(instance=instance):
            status = InstanceStatus.READY
    return instance_id, status, [str(pk) for pk in cancel]


def _parse_body(request: HttpRequest) -> dict[str, Any] | JsonResponse:
    if not request.body:
        return {}
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError):
        return _error(400, "parse_error", "the request body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "invalid", "the request body must be a JSON object")
    running = body.get("running_job")
    if running is not None:
        try:
            uuid.UUID(str(running))
        except ValueError:
            return _error(400, "invalid", "running_job: must be a valid UUID")
    return body


@csrf_exempt  # authenticated by the Agent token header, never by a cookie
async def heartbeat(request: HttpRequest) -> HttpResponse:
    """``POST heartbeat`` → ``{cancel: [job ids], terminate: bool}``."""
    if request.method != "POST":
        return _error(405, "method_not_allowed", f'Method "{request.method}" not allowed.', Allow="POST")
    digest = _token_hash(request)
    if isinstance(digest, JsonResponse):
        return digest
    body = _parse_body(request)
    if isinstance(body, JsonResponse):
        return body
    row = await db.run(_heartbeat, digest)
    if row is None:
        return _gone()
    _, status, cancel = row
    return JsonResponse({"cancel": cancel, "terminate": status == InstanceStatus.TERMINATING})


# ---- work (long poll) --------------------------------------------------------------------------


def _instance(digest: str) -> tuple[uuid.UUID, str] | None:
    return (
        MachineInstance.objects.filter(agent_token_hash=digest, status__in=LIVE)
        .exclude(agent_token_hash="")
        .values_list("pk", "status")
        .first()
    )


def _assigned(instance_id: uuid.UUID) -> dict[str, Any] | None:
    job = (
        Job.objects.filter(instance_id=instance_id, status=JobStatus.ASSIGNED)
        .select_related("config")
        .order_by("assigned_at")
        .first()
    )
    return None if job is None else _payload(job)


def _instance_and_assigned(digest: str) -> tuple[uuid.UUID, dict[str, Any] | None] | None:
    found = _instance(digest)
    if found is None:
        return None
    return found[0], _assigned(found[0])


def _wait_seconds(request: HttpRequest) -> float:
    limit = float(settings.CATACLOUD_AGENT_POLL_TIMEOUT)
    try:
        wait = float(request.GET.get("wait", limit))
    except ValueError:
        wait = limit
    if math.isnan(wait):
        wait = limit
    return max(0.0, min(wait, limit))


# One round trip: this poll becomes the instance's only one (a newer generation) and the older
# poll, woken by "poll:<generation>", answers 204.
TAKE_OVER = """
local generation = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[2], 'poll:' .. generation)
return generation
"""


async def _take_over(redis: Any, instance_id: uuid.UUID) -> int | None:
    try:
        generation = await redis.eval(
            TAKE_OVER,
            2,
            POLL_KEY.format(instance_id),
            WAKE_KEY.format(instance_id),
            int(settings.CATACLOUD_AGENT_POLL_TIMEOUT) + 60,
        )
        return int(generation)
    except Exception:  # Redis down: no replacement, the poll still ends at its timeout
        return None


async def _superseded(redis: Any, instance_id: uuid.UUID, generation: int | None) -> bool:
    if generation is None:
        return False
    try:
        current = await redis.get(POLL_KEY.format(instance_id))
    except Exception:
        return False
    return current is not None and int(current) != generation


def _newer_poll(messages: list[str], generation: int | None) -> bool | None:
    """True: a newer poll took over; False: only this poll's own announcement; None: look."""
    others = [m for m in messages if not m.startswith("poll:")]
    polls = [int(m[5:]) for m in messages if m.startswith("poll:") and m[5:].isdigit()]
    if generation is not None and any(p > generation for p in polls):
        return True
    return None if others or not messages else False


@csrf_exempt
async def work(request: HttpRequest) -> HttpResponse:
    """``GET work?wait=S``: ``{job: {...}}`` the moment a job is assigned here, else 204 after
    ``wait`` seconds (at most ``CATACLOUD_AGENT_POLL_TIMEOUT``)."""
    if request.method != "GET":
        return _error(405, "method_not_allowed", f'Method "{request.method}" not allowed.', Allow="GET")
    digest = _token_hash(request)
    if isinstance(digest, JsonResponse):
        return digest
    deadline = time.monotonic() + _wait_seconds(request)
    found = await db.run(_instance, digest)
    if found is None:
        return _gone()
    instance_id = found[0]
    async with wakeups.waiter_for(instance_id) as waiter:
        # Subscribed before looking: an assignment committed from now on wakes this poll.
        redis = waiter.listener.redis()
        generation = await _take_over(redis, instance_id)
        look = True
        while True:
            if look:
                job = await db.run(_assigned, instance_id)
                if job is not None:
                    return JsonResponse({"job": job})
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return HttpResponse(status=204)
            messages = await waiter.wait(remaining)
            newer = _newer_poll(messages, generation)
            if newer or (newer is None and messages and await _superseded(redis, instance_id, generation)):
                return HttpResponse(status=204)  # a newer poll of this machine took over
            look = newer is None  # woken by an assignment, a reconnect or the timeout: look again
