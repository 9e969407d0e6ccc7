"""Thin tasks: take primary keys, exit quietly when there is nothing to do, call one service,
retry only typed transient provider errors with backoff."""

from __future__ import annotations

import logging
from uuid import UUID

from celery import Task, shared_task

from apps.core.broker import task_backoff
from apps.machines import lifecycle
from catacloud.providers import InsufficientCapacity, ProviderError

log = logging.getLogger(__name__)

MAX_RETRIES = 8


@shared_task(bind=True, max_retries=MAX_RETRIES, acks_late=True)
def provision_instance_task(self: Task, instance_id: str) -> None:
    try:
        lifecycle.instance_provision(instance_id=UUID(instance_id))
    except InsufficientCapacity as exc:
        log.warning("provisioning %s: %s: its machine type cools down", instance_id, exc.code)
        lifecycle.instance_no_capacity(instance_id=UUID(instance_id), reason=f"{exc.code}: {exc}")
    except ProviderError as exc:
        if exc.retryable and self.request.retries < MAX_RETRIES:
            log.warning("provisioning %s: %s (retry %d)", instance_id, exc.code, self.request.retries + 1)
            raise self.retry(countdown=task_backoff(self.request.retries, exc.retry_after)) from None
        if exc.retryable:  # a passing trouble that outlasted the retries
            lifecycle.instance_fail(instance_id=UUID(instance_id), reason=f"{exc.code}: {exc}")
            return
        # A refusal every machine of the type would get (a quota reached, a credential or setting
        # the provider refuses): the type cools down as after a capacity error, instead of a new
        # machine bought and refused at every scheduler tick while a job waits.
        log.warning("provisioning %s: %s: its machine type cools down", instance_id, exc.code)
        lifecycle.instance_no_capacity(instance_id=UUID(instance_id), reason=f"{exc.code}: {exc}")


@shared_task(bind=True, max_retries=MAX_RETRIES, acks_late=True)
def terminate_instance_task(self: Task, instance_id: str) -> None:
    try:
        lifecycle.instance_destroy(instance_id=UUID(instance_id))
    except ProviderError as exc:
        # Deleting must eventually succeed: retry everything; the reaper retries after that.
        log.warning("terminating %s: %s (retry %d)", instance_id, exc.code, self.request.retries + 1)
        raise self.retry(countdown=task_backoff(self.request.retries, exc.retry_after)) from None


@shared_task(bind=True, max_retries=MAX_RETRIES, acks_late=True)
def destroy_machine_task(self: Task, account_id: str, provider_id: str, instance_id: str) -> None:
    try:
        lifecycle.machine_destroy(
            account_id=UUID(account_id), provider_id=provider_id, instance_id=instance_id
        )
    except ProviderError as exc:
        raise self.retry(countdown=task_backoff(self.request.retries, exc.retry_after)) from None


@shared_task(acks_late=True, ignore_result=True)
def refresh_provider_state_task(instance_id: str) -> None:
    """Record what the provider says of a machine now (state, addresses). Best effort: the
    reconciler refreshes every live machine at each reaper tick anyway."""
    try:
        lifecycle.instance_refresh_provider_state(instance_id=UUID(instance_id))
    except ProviderError as exc:
        log.info("provider state of %s not refreshed: %s", instance_id, exc.code)
