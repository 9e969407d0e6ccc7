"""Every message the jobs app sends, in one module: its Celery tasks (by name, so no service
imports ``apps.jobs.tasks``, which imports the services) and an agent's wake-up. Messages only
make things faster: the reaper and the agent's long poll find the same work without them, so a
message lost with the broker delays a row, never strands it.

Imports nothing of the jobs app (an import-linter contract keeps it so).
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from apps.core import broker, tracing
from apps.core.broker import enqueue_on_commit, redis_client
from apps.core.ids import InstanceId, JobId

# The jobs app's tasks (apps/jobs/tasks.py), by their registered names.
SCHEDULE_TASK = "apps.jobs.tasks.schedule_task"
ACQUIRE_RESOURCES_TASK = "apps.jobs.tasks.acquire_resources_task"

# The pub/sub channel that wakes an instance's long poll (GET work, apps.control.agent.views).
WAKE_KEY = broker.WAKE_KEY
# The generation of an instance's current long poll: a newer poll replaces an older one.
POLL_KEY = "catacloud:poll:{}"


def schedule_after_commit() -> None:
    """A scheduling pass (admission, then placement) right after the current transaction commits."""
    enqueue_on_commit(SCHEDULE_TASK)


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
