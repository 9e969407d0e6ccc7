"""The Agent API's hot endpoints: the heartbeat (one statement), the long poll for work (waits on a
Redis wake-up, holding no thread and no database connection) and a job's start (one statement:
the job's first instruction waits for its answer).

Each is one coroutine that takes what it needs from the request (the ``Authorization`` header,
the body or the ``wait`` parameter) and returns an :class:`Answer`; two thin adapters serve it:
the agent server's own ASGI route (:mod:`apps.control.agent.asgi`, no Django request or
response on the hot path) and the Django async views below (the WSGI web and the test client).

They span machines (the instance, its heartbeat) and jobs (its assignment, its cancellations),
so they live in the top app. The other agent endpoints stay the apps' DRF views; the agent
server runs them on its database threads (:func:`apps.control.agent.urls.on_db_threads`).
"""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from apps.control.agent import db, wakeups
from apps.control.agent.auth import AgentRateThrottle
from apps.core import tracing
from apps.core.crypto import hash_token
from apps.core.db import sql_literals
from apps.core.errors import ErrorCode, error_payload
from apps.core.ids import JobId
from apps.core.parsers import loads
from apps.jobs.choices import JobStatus
from apps.jobs.dispatch import POLL_KEY, WAKE_KEY
from apps.jobs.handoff import HANDED_OFF_SQL, handed_off
from apps.jobs.models import Job
from apps.jobs.reports import NOT_ASSIGNED, job_image_unrunnable, job_started_by_token
from apps.jobs.selectors import job_payload, with_payload_facts
from apps.machines.agents import AGENT_TOKEN_PREFIX, instance_heartbeat, live_token_sql
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance
from catacloud.protocol import HeartbeatAnswer, Started

CANCELLABLE = sql_literals([JobStatus.ASSIGNED, JobStatus.RUNNING])


@dataclass
class Answer:
    """An endpoint's answer: status, JSON body (None: no body) and extra headers."""

    status: int
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def error_answer(status: int, code: ErrorCode, detail: str, **headers: str) -> Answer:
    """An error ``Answer``: the API's ``{code, detail}`` body, ``headers`` with ``_`` for ``-``."""
    return Answer(status, error_payload(code, detail), {k.replace("_", "-"): v for k, v in headers.items()})


def _unauthenticated(code: ErrorCode, detail: str) -> Answer:
    return error_answer(401, code, detail, WWW_Authenticate="Agent")


def method_not_allowed(method: str, allowed: str) -> Answer:
    return error_answer(405, ErrorCode.METHOD_NOT_ALLOWED, f'Method "{method}" not allowed.', Allow=allowed)


class _TokenThrottle(AgentRateThrottle):
    """``CATACLOUD_AGENT_RATE`` counted per agent token before any database work."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.token_key = key

    def get_cache_key(self, request: Any, view: Any) -> str:
        return f"throttle_agent_t{self.token_key[:32]}"


def _token_hash(authorization: str) -> str | Answer:
    """The agent token's hash, or the 401/429 answer (same codes as the DRF agent views)."""
    parts = authorization.split()
    if not parts or parts[0] != "Agent":
        return _unauthenticated(ErrorCode.NOT_AUTHENTICATED, "Authentication credentials were not provided.")
    if len(parts) != 2 or not parts[1].startswith(f"{AGENT_TOKEN_PREFIX}_"):
        return _unauthenticated(ErrorCode.AUTHENTICATION_FAILED, "invalid agent token")
    digest = hash_token(parts[1])
    throttle = _TokenThrottle(digest)
    if not throttle.allow_request(None, None):  # type: ignore[arg-type]  # keyed by the token alone
        wait = throttle.wait()
        retry = str(math.ceil(wait)) if wait else "1"
        return error_answer(429, ErrorCode.THROTTLED, "Request was throttled.", Retry_After=retry)
    return digest


def _gone() -> Answer:
    return _unauthenticated(ErrorCode.AUTHENTICATION_FAILED, "unknown agent token, or the machine has ended")


# ---- heartbeat ---------------------------------------------------------------------------------

# What the hot statements share: an agent token that names a live machine; a machine's jobs to
# kill; a job assigned to a machine and handed to it (apps.jobs.handoff: an integration's job is
# given only once handed off).
_LIVE_TOKEN = live_token_sql("m")
_TO_CANCEL = f"""ARRAY(
    SELECT j.id FROM {Job._meta.db_table} AS j
    WHERE j.instance_id = m.id AND j.cancel_requested AND j.status IN ({CANCELLABLE}) ORDER BY j.id
)"""
_ASSIGNED = f"status IN ({sql_literals([JobStatus.ASSIGNED])}) AND {HANDED_OFF_SQL}"
_MACHINES = MachineInstance._meta.db_table
_JOBS = Job._meta.db_table

# Authenticate, record the heartbeat and read the jobs to kill, in one autocommit statement that
# takes no lock beyond the row's own UPDATE (it never waits behind a long poll, which holds none).
HEARTBEAT = f"""
UPDATE {_MACHINES} AS m SET last_heartbeat_at = %s
WHERE m.agent_token_hash = %s AND {_LIVE_TOKEN}
RETURNING m.id, m.status, {_TO_CANCEL}
"""
# The same for the heartbeats that arrived together (db.Batched). Rows are locked in id order and
# a row another transaction holds is skipped (its heartbeat then runs HEARTBEAT alone and waits),
# so a batch never waits on a lock and two batches cannot deadlock.
HEARTBEATS = f"""
WITH hit AS (
    SELECT m.id FROM {_MACHINES} AS m
    WHERE m.agent_token_hash = ANY(%s) AND {_LIVE_TOKEN}
    ORDER BY m.id FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE {_MACHINES} AS m SET last_heartbeat_at = %s FROM hit WHERE m.id = hit.id
RETURNING m.agent_token_hash, m.id, m.status, {_TO_CANCEL}
"""
_HEARTBEATS = db.Batched(
    HEARTBEAT,
    HEARTBEATS,
    params=lambda digests: [digests, timezone.now()],
    one_params=lambda digest: [timezone.now(), digest],
    retry_missing=True,
)


def _handshake(instance_id: uuid.UUID) -> bool:
    """The first heartbeat of a warming machine makes it ready (once per machine; the usual
    service path, on a database thread)."""
    instance = MachineInstance.objects.filter(pk=instance_id).first()
    return instance is not None and instance_heartbeat(instance=instance)


def _parse_body(body: bytes) -> dict[str, Any] | Answer:
    if not body:
        return {}
    try:
        parsed = loads(body)  # deeply nested: a ValueError too, before any token is looked up
    except ValueError:
        return error_answer(400, ErrorCode.PARSE_ERROR, "the request body is not valid JSON")
    if not isinstance(parsed, dict):
        return error_answer(400, ErrorCode.INVALID, "the request body must be a JSON object")
    running = parsed.get("running_job")
    if running is not None:
        try:
            uuid.UUID(str(running))
        except ValueError:
            return error_answer(400, ErrorCode.INVALID, "running_job: must be a valid UUID")
    return parsed


async def heartbeat_answer(authorization: str, body: bytes) -> Answer:
    """``POST heartbeat`` → ``{cancel: [job ids], terminate: bool}``."""
    digest = _token_hash(authorization)
    if isinstance(digest, Answer):
        return digest
    parsed = _parse_body(body)
    if isinstance(parsed, Answer):
        return parsed
    row = await _HEARTBEATS.row(digest)
    if row is None:
        return _gone()
    instance_id, status, cancel = row
    if status == InstanceStatus.WARMING and await db.run(_handshake, instance_id):
        status = InstanceStatus.READY
    terminate = status == InstanceStatus.TERMINATING
    return Answer(200, HeartbeatAnswer(cancel=tuple(str(pk) for pk in cancel), terminate=terminate).to_json())


# ---- work (long poll) --------------------------------------------------------------------------


INSTANCE = f"SELECT m.id FROM {_MACHINES} AS m WHERE m.agent_token_hash = %s AND {_LIVE_TOKEN}"
INSTANCES = (
    f"SELECT m.agent_token_hash, m.id FROM {_MACHINES} AS m "
    f"WHERE m.agent_token_hash = ANY(%s) AND {_LIVE_TOKEN}"
)
# The machine a live agent token names (a poll; the agent server's budgets in admission).
instance_by_token = db.Batched(INSTANCE, INSTANCES, params=lambda keys: [keys], one_params=lambda d: [d])

HAS_ASSIGNED = f"SELECT instance_id FROM {_JOBS} WHERE instance_id = %s AND {_ASSIGNED} LIMIT 1"
WITH_ASSIGNED = f"SELECT DISTINCT instance_id FROM {_JOBS} WHERE instance_id = ANY(%s) AND {_ASSIGNED}"
_WITH_ASSIGNED = db.Batched(HAS_ASSIGNED, WITH_ASSIGNED, params=lambda keys: [keys], one_params=lambda i: [i])


def _assigned(instance_id: uuid.UUID, poll_began: float) -> dict[str, Any] | None:
    assigned = Job.objects.filter(handed_off(), instance_id=instance_id, status=JobStatus.ASSIGNED)
    job = with_payload_facts(assigned).order_by("assigned_at").first()
    if job is None:
        return None
    if job.image and job_image_unrunnable(job=job):
        return None  # ended with image_unusable: an agent that would ignore the image never gets it
    payload = job_payload(job)
    Job.objects.filter(pk=job.pk).update(delivered_at=timezone.now())  # `jobs show --timing`
    since = max(poll_began, job.assigned_at.timestamp()) if job.assigned_at else poll_began
    tracing.record("poll answer", traceparent=job.traceparent, start=since, instance=str(instance_id))
    return payload


async def _look(instance_id: uuid.UUID, poll_began: float) -> dict[str, Any] | None:
    """The job assigned to this machine, if any: one prepared statement, and the ORM (on a
    database thread) only when there is one to hand out."""
    if await _WITH_ASSIGNED.row(instance_id) is None:
        return None
    return await db.run(_assigned, instance_id, poll_began)


# A poll with nothing to hand out ends after its wait less up to this share of it, at random:
# polls that began together (a fleet started or reconnected at once) do not all end, and renew,
# in the same second again.
POLL_JITTER = 0.25


def _wait_seconds(wait_param: str | None) -> float:
    limit = float(settings.CATACLOUD_AGENT_POLL_TIMEOUT)
    try:
        wait = float(wait_param if wait_param is not None else limit)
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


async def work_answer(authorization: str, wait_param: str | None) -> Answer:
    """``GET work?wait=S``: ``{job: {...}}`` the moment a job is assigned here, else 204 after
    ``wait`` seconds (at most ``CATACLOUD_AGENT_POLL_TIMEOUT``) less up to ``POLL_JITTER``."""
    digest = _token_hash(authorization)
    if isinstance(digest, Answer):
        return digest
    began = time.time()
    deadline = time.monotonic() + _wait_seconds(wait_param) * random.uniform(1 - POLL_JITTER, 1)
    found = await instance_by_token.row(digest)
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
                job = await _look(instance_id, began)
                if job is not None:
                    return Answer(200, {"job": job})
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Answer(204)
            messages = await waiter.wait(remaining)
            newer = _newer_poll(messages, generation)
            if newer or (newer is None and messages and await _superseded(redis, instance_id, generation)):
                return Answer(204)  # a newer poll of this machine took over
            look = newer is None  # woken by an assignment, a reconnect or the timeout: look again


# ---- a job's start -----------------------------------------------------------------------------


# What the agent may say it spent before its start report (a day, like a finished report's launch_ms).
MAX_AGENT_MS = 86_400_000


async def started_answer(authorization: str, job_id: JobId, body: bytes) -> Answer:
    """``POST jobs/<id>/started`` → ``{ok: true}``: the job, assigned to this machine, runs (one
    statement on a database thread: :func:`apps.jobs.reports.job_started_by_token`); 409
    ``not_assigned`` when it is not (or no longer) this machine's. The agent's command waits at
    its sandbox's gate for this answer, so it is on the path to the job's first instruction."""
    digest = _token_hash(authorization)
    if isinstance(digest, Answer):
        return digest
    agent_ms = None
    if body:
        try:
            parsed = loads(body)
        except ValueError:
            return error_answer(400, ErrorCode.PARSE_ERROR, "the request body is not valid JSON")
        if parsed:  # an agent from before protocol's Started sends no body
            try:
                agent_ms = Started.from_json(parsed).agent_ms
            except ValueError as exc:
                return error_answer(400, ErrorCode.INVALID, str(exc))
            if not 0 <= agent_ms <= MAX_AGENT_MS:  # NaN too: no number to store or to time a span by
                detail = f"agent_ms: milliseconds from 0 to {MAX_AGENT_MS}"
                return error_answer(400, ErrorCode.INVALID, detail)
    moved = await db.run(job_started_by_token, token_hash=digest, job_id=job_id, agent_ms=agent_ms)
    if moved is None:
        return _gone()
    if not moved:
        return error_answer(409, ErrorCode.NOT_ASSIGNED, NOT_ASSIGNED)
    return Answer(200, {"ok": True})


# ---- the Django adapters (the WSGI web, the test client) ---------------------------------------


def _response(answer: Answer) -> HttpResponse:
    response: HttpResponse = (
        HttpResponse(status=answer.status)
        if answer.body is None
        else JsonResponse(answer.body, status=answer.status)
    )
    for name, value in answer.headers.items():
        response[name] = value
    return response


@csrf_exempt  # authenticated by the Agent token header, never by a cookie
async def heartbeat(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _response(method_not_allowed(str(request.method), "POST"))
    return _response(await heartbeat_answer(request.headers.get("Authorization", ""), request.body))


@csrf_exempt
async def work(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return _response(method_not_allowed(str(request.method), "GET"))
    return _response(await work_answer(request.headers.get("Authorization", ""), request.GET.get("wait")))


@csrf_exempt
async def started(request: HttpRequest, job_id: JobId) -> HttpResponse:
    if request.method != "POST":
        return _response(method_not_allowed(str(request.method), "POST"))
    return _response(await started_answer(request.headers.get("Authorization", ""), job_id, request.body))
