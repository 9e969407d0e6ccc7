"""The broker boundary: the shared Redis client for messages that are not Celery tasks
(wake-ups, de-duplication) and best-effort task enqueueing.

Redis carries messages here, never state that matters: losing any of it only delays work
until the next poll or reaper tick. So an enqueue after a committed change never fails the
change: when the broker is down the message is dropped with a warning and the reaper, which
compares rows with their deadlines, moves the row instead (docs/architecture/convergence.md).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import redis
from celery import Task, current_app
from django.conf import settings
from django.db import transaction
from kombu.exceptions import KombuError, OperationalError

from catacloud.agent.backoff import backoff

log = logging.getLogger(__name__)

# What a publish raises when Redis is down or refuses (kombu wraps redis' errors, mostly).
BROKER_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    KombuError,
    redis.RedisError,
    ConnectionError,
    OSError,
)


# The pub/sub channel that wakes a long poll (an instance's GET work; an enrolled host's exchange,
# keyed ``host-<id>``: apps.control.agent); a wake-up is a hint, the poll re-reads PostgreSQL.
WAKE_KEY = "catacloud:wake:{}"


def wake(key: object, message: str) -> int:
    """Publish a wake-up for ``key``'s long poll; its listeners woken (-1: Redis is down)."""
    try:
        return int(redis_client().publish(WAKE_KEY.format(key), message))
    except redis.RedisError:
        return -1


@functools.cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.CELERY_BROKER_URL,
        socket_timeout=settings.CATACLOUD_AGENT_POLL_TIMEOUT + 5,
        socket_connect_timeout=2,
        health_check_interval=30,
    )


# A broker that just failed is not asked again for a few seconds in this process: a request
# made while Redis is down then costs no connect timeout (the reaper catches up afterwards).
BROKER_BACKOFF_SECONDS = 5.0
_down_until = 0.0


def broker_down() -> bool:
    """True while this process saw the broker fail within the last few seconds."""
    return time.monotonic() < _down_until


def mark_broker_down(exc: BaseException) -> None:
    global _down_until
    if not broker_down():
        log.warning("broker unavailable (the reaper re-drives what was not sent): %s", exc)
    _down_until = time.monotonic() + BROKER_BACKOFF_SECONDS


def enqueue(task: Task[Any, Any] | str, *args: Any, countdown: float = 0.0) -> bool:
    """Send ``task(*args)`` to the workers, best effort. ``task`` is the task or its registered
    name (``"apps.jobs.tasks.schedule_task"``): a service sends by name, so it never imports the
    tasks module that imports it. Returns False when the broker is unreachable (or failed
    moments ago); the reaper's deadline rules re-drive the row later. ``countdown`` (if not 0): run it
    that many seconds from now (a worker holds it until then; keep it well under the broker's
    visibility timeout, or it is delivered again)."""
    if broker_down():
        return False
    name = task if isinstance(task, str) else task.name
    try:
        if isinstance(task, str):
            current_app.send_task(task, args=args, retry=False, countdown=countdown)
        else:
            task.apply_async(args=args, retry=False, countdown=countdown)
    except BROKER_ERRORS as exc:
        mark_broker_down(exc)
        return False
    except Exception:  # after a commit nothing may fail the request: the reaper re-drives
        log.exception("could not enqueue %s%r (the reaper will re-drive it)", name, args)
        return False
    return True


def enqueue_on_commit(task: Task[Any, Any] | str, *args: Any) -> None:
    """:func:`enqueue` right after the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: enqueue(task, *args))


def task_backoff(retries: int, retry_after: float | None = None) -> float:
    """A Celery task's retry countdown: up to 5 minutes, honouring the provider's hint."""
    return backoff(retries, base=1.0, cap=300.0, hint=retry_after)
