"""The Celery app. Settings come from Django settings under the ``CELERY_`` namespace."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import beat_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("catacloud")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@beat_init.connect
def _reaper_in_beat(**_: Any) -> None:
    """Beat runs the reaper itself, in a thread of its own process, every
    CATACLOUD_REAPER_INTERVAL seconds: a tick sent through the broker to a worker would be lost
    exactly when Redis or the workers are down, the faults the reaper repairs."""
    import threading

    import django

    django.setup()
    from django.conf import settings

    from apps.control.reaper import serve

    stop = threading.Event()
    threading.Thread(
        target=serve, args=(settings.CATACLOUD_REAPER_INTERVAL, stop), name="reaper", daemon=True
    ).start()
