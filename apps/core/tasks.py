from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from apps.core.models import Heartbeat


@shared_task(ignore_result=True)
def beat_heartbeat_task() -> None:
    """Sent by beat every 10 s and run by a worker: a fresh mark proves both are alive."""
    Heartbeat.objects.update_or_create(name="beat", defaults={"seen_at": timezone.now()})
