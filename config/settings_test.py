"""Settings of the test suite (pytest-django's ``DJANGO_SETTINGS_MODULE``): the production
settings, with what keeps tests away from a running ``make dev`` and makes bugs loud.

Processes the tests start (web, worker, beat) get the same values through their environment
(testkit/processes.py, its TESTS profile), so they run ``config.settings`` unchanged.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from django.core.exceptions import ImproperlyConfigured

from config.settings import *  # noqa: F403
from config.settings import CACHES, DATABASES, env

# Threads (live server, concurrency tests) must not keep connections open.
DATABASES["default"]["CONN_MAX_AGE"] = 0
# Another Redis database, so tests never touch a running `make dev`; under pytest-xdist each
# worker (gw0, gw1, ...) one of its own below it, so one worker's Celery never takes another's
# tasks (pytest-django gives each its own test database the same way).
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_redis_db = env.int("CATACLOUD_TEST_REDIS_DB", default=15) - (int(_worker[2:]) + 1 if _worker else 0)
if _redis_db < 0:
    raise ImproperlyConfigured(f"no Redis database left for test worker {_worker}: run fewer")
REDIS_URL = urlunsplit(
    urlsplit(env.str("REDIS_URL", default="redis://127.0.0.1:6379/0"))._replace(path=f"/{_redis_db}")
)
CELERY_BROKER_URL = REDIS_URL
CACHES["default"]["LOCATION"] = REDIS_URL
# An unregistered event kind or error code is a bug: raise.
CATACLOUD_STRICT_REGISTRIES = True
