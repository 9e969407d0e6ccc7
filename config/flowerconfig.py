"""Flower's configuration file (``celery -A config flower --conf=config/flowerconfig.py``).

Flower 2 serves ``/metrics`` (its Prometheus text: every task name, worker and queue) without
asking for the basic auth (``FLOWER_BASIC_AUTH``) that guards every other page. Flower executes
this file in its own process before it serves: ``/metrics`` gets the same check as the pages.
Only ``/healthcheck`` (it answers "OK") stays open.
"""

from __future__ import annotations

import tornado.web
from flower.views import monitor

if not getattr(monitor.Metrics.get, "__wrapped__", None):  # once, even if the file is read twice
    monitor.Metrics.get = tornado.web.authenticated(monitor.Metrics.get)
