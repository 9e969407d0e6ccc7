from __future__ import annotations

import logging
from typing import Any
from uuid import UUID

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown

from apps.pools.services import pool_refill

log = logging.getLogger(__name__)


@shared_task(ignore_result=True, acks_late=True)
def pool_refill_task(pool_id: str) -> None:
    """Converge one pool right after a claim, a termination or a member becoming ready
    (enqueued by the refill listener, apps.pools.refill)."""
    pool_refill(pool_id=UUID(pool_id))


@worker_ready.connect
def _start_refill_listener(**_: Any) -> None:
    from apps.pools.refill import start_listener

    start_listener()


@worker_shutdown.connect
def _stop_refill_listener(**_: Any) -> None:
    from apps.pools.refill import stop_listener

    stop_listener()
