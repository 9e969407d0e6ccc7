from __future__ import annotations

import contextlib
import logging

import redis
from celery import shared_task

from apps.core.broker import broker_down, enqueue, mark_broker_down, redis_client
from apps.pools import reaper
from apps.pools.services import pool_refill

log = logging.getLogger(__name__)


REFILL_PENDING = "catacloud:refill-pending:{}"


def request_refill(pool_id: str) -> None:
    """Enqueue one refill for the pool unless one is already waiting to run.

    A burst of claims on one pool then costs one task, not one per claim. The task clears the
    mark *before* it reads the pool, so a claim committed after that enqueues a new refill;
    if the mark is ever lost or stale, the reaper's tick still converges the pool.
    """
    if broker_down():
        return  # the reaper's tick refills the pool
    try:
        fresh = redis_client().set(REFILL_PENDING.format(pool_id), "1", nx=True, ex=60)
    except redis.RedisError as exc:
        mark_broker_down(exc)
        return
    if fresh and not enqueue(pool_refill_task, pool_id):
        with contextlib.suppress(redis.RedisError):
            redis_client().delete(REFILL_PENDING.format(pool_id))


@shared_task(ignore_result=True, acks_late=True)
def pool_refill_task(pool_id: str) -> None:
    """Converge one pool right after a claim, a termination or a member becoming ready."""
    with contextlib.suppress(redis.RedisError):
        redis_client().delete(REFILL_PENDING.format(pool_id))
    pool_refill(pool_id=pool_id)


@shared_task(ignore_result=True)
def reaper_task() -> None:
    """Celery beat, every CATACLOUD_REAPER_INTERVAL seconds (single instance by advisory lock)."""
    report = reaper.reaper_tick()
    if report.ran:
        log.info(
            "reaper: %d pools, %d refilled (+%d members), %d stuck, %d lost, %d schedules, "
            "%d reconcile actions in %.3fs",
            report.pools,
            report.refilled,
            report.requested,
            report.stuck,
            report.lost,
            report.schedules_applied,
            report.reconcile_actions,
            report.seconds,
        )
