"""Every message the jobs app sends, in one module: its Celery tasks (by name, so no service
imports ``apps.jobs.tasks``, which imports the services) and an agent's wake-up. Messages only
make things faster: the reaper and the agent's long poll find the same work without them, so a
message lost with the broker delays a row, never strands it.

Imports nothing of the jobs app (an import-linter contract keeps it so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import redis
from django.db import transaction

from apps.core import broker, tracing
from apps.core.broker import enqueue_on_commit, redis_client
from apps.core.ids import InstanceId, JobId

# The jobs app's tasks (apps/jobs/tasks.py), by their registered names.
SCHEDULE_TASK = "apps.jobs.tasks.schedule_task"
ACQUIRE_RESOURCES_TASK = "apps.jobs.tasks.acquire_resources_task"

# A scheduling pass is sent and has not started: commits meanwhile send none of their own. The mark
# lapses after SCHEDULE_PENDING_SECONDS, should the pass be lost (a worker killed, the broker
# flushed): a later commit sends one again, and beat's pass runs every CATACLOUD_SCHEDULER_INTERVAL.
SCHEDULE_PENDING_KEY = "catacloud:schedule:pending"
SCHEDULE_PENDING_SECONDS = 5

# The pub/sub channel that wakes an instance's long poll (GET work, apps.control.agent.views).
WAKE_KEY = broker.WAKE_KEY
# The generation of an instance's current long poll: a newer poll replaces an older one.
POLL_KEY = "catacloud:poll:{}"


def schedule_after_commit() -> None:
    """A scheduling pass (admission, then placement) right after the current transaction
    commits, unless one is sent and not started yet: that one sees this commit (it clears its
    mark as it starts, :func:`schedule_started`). A burst of job ends then brings a pass or two,
    not one each (a job's end asked for two: the job's and its machine's)."""
    transaction.on_commit(_schedule_once)


def _schedule_once() -> None:
    if broker.broker_down():  # failed moments ago: no call to wait on now (the reaper re-drives)
        return
    try:
        mine = bool(redis_client().set(SCHEDULE_PENDING_KEY, "1", nx=True, ex=SCHEDULE_PENDING_SECONDS))
    except redis.RedisError:
        mine = True  # the broker is Redis too: enqueue says what it can
    if mine and not broker.enqueue(SCHEDULE_TASK):
        with contextlib.suppress(redis.RedisError):
            redis_client().delete(SCHEDULE_PENDING_KEY)  # not sent: the next commit tries again


def schedule_started() -> None:
    """A scheduling pass starts: what commits from now on sends another (its mark goes)."""
    with contextlib.suppress(redis.RedisError):
        redis_client().delete(SCHEDULE_PENDING_KEY)


def acquire_after_commit(job_ids: Iterable[JobId]) -> None:
    """Each job's resource acquisition right after the current transaction commits."""
    for job_id in job_ids:
        enqueue_on_commit(ACQUIRE_RESOURCES_TASK, str(job_id))


def wake_agent(instance_id: InstanceId, *, traceparent: str = "") -> None:
    """Wake the agent of ``instance_id`` if it is long-polling (best effort: a poll looks at
    PostgreSQL when it starts and when it times out). Pub/sub: the agent server's listener
    (apps.control.agent.wakeups) hands it to the poll waiting for this instance. ``traceparent``:
    the job's trace, where the wake-up's span goes."""
    with tracing.span("wake-up", traceparent=traceparent, instance=str(instance_id)) as span:
        try:
            woken = redis_client().publish(WAKE_KEY.format(instance_id), "job")
        except redis.RedisError as exc:
            woken = -1
            if span is not None:
                span.set_attribute("error", type(exc).__name__)
        if span is not None:
            span.set_attribute("listeners", int(woken))
