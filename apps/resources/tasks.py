from __future__ import annotations

import logging
from uuid import UUID

from celery import Task, shared_task

from apps.core.broker import task_backoff
from apps.resources.lifecycle import resource_destroy, resource_destroy_refused
from apps.resources.wells import WellError

log = logging.getLogger(__name__)


@shared_task(bind=True, max_retries=None, acks_late=True)
def destroy_resource_task(self: Task, resource_id: str) -> None:
    """Destroying must eventually succeed: retried with backoff (capped at 5 minutes) until it
    does; permanent refusals leave the resource ``failed`` for the reaper to retry."""
    try:
        resource_destroy(resource_id=UUID(resource_id))
    except WellError as exc:
        if exc.retryable:
            log.warning("destroying resource %s: %s (retry %d)", resource_id, exc, self.request.retries + 1)
            raise self.retry(countdown=task_backoff(self.request.retries)) from None
        resource_destroy_refused(resource_id=UUID(resource_id), exc=exc)
