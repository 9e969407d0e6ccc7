"""The shared Redis client for messages that are not Celery tasks (wake-ups, de-duplication).
Redis carries messages here, never state that matters: losing any of it only delays work
until the next poll or reaper tick."""

from __future__ import annotations

import functools

import redis
from django.conf import settings


@functools.cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.CELERY_BROKER_URL,
        socket_timeout=settings.CATACLOUD_AGENT_POLL_TIMEOUT + 5,
        socket_connect_timeout=2,
        health_check_interval=30,
    )
