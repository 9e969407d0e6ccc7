"""Flower's configuration file (``celery -A config flower --conf=config/flowerconfig.py``).

Flower 2 serves ``/metrics`` (its Prometheus text: every task name, worker and queue) without
asking for the basic auth (``FLOWER_BASIC_AUTH``) that guards every other page. Flower executes
this file in its own process before it serves: ``/metrics`` gets the same check as the pages.
Only ``/healthcheck`` (it answers "OK") stays open.

At start Flower asks the workers for their stats, queues, tasks and configuration; under
`make dev` it starts together with the worker, before any worker listens for the question, so
every start logged four ``Inspect method … failed`` warnings. Flower sees the worker anyway
from its events (workers run with ``-E``), and a refresh asks again. Its inspector's warnings
(no answer) are dropped; its errors (a failed inspection) still show.
"""

from __future__ import annotations

import logging as _logging  # not `logging`: that name is one of Flower's options

import tornado.web
from flower.views import monitor

if not getattr(monitor.Metrics.get, "__wrapped__", None):  # once, even if the file is read twice
    monitor.Metrics.get = tornado.web.authenticated(monitor.Metrics.get)

_logging.getLogger("flower.inspector").setLevel(_logging.ERROR)
