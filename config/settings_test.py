"""Settings of the test suite (pytest-django's ``DJANGO_SETTINGS_MODULE``): the production
settings, with what keeps tests away from a running ``make dev`` and makes bugs loud.

Processes the tests start (web, worker, beat) get the same values through their environment
(testkit/processes.py, its TESTS profile), so they run ``config.settings`` unchanged.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from config.settings import *  # noqa: F403
from config.settings import CACHES, DATABASES, env

# Threads (live server, concurrency tests) must not keep connections open.
DATABASES["default"]["CONN_MAX_AGE"] = 0
# Another Redis database, so tests never touch a running `make dev`.
REDIS_URL = urlunsplit(
    urlsplit(env.str("REDIS_URL", default="redis://127.0.0.1:6379/0"))._replace(
        path=f"/{env.int('CATACLOUD_TEST_REDIS_DB', default=15)}"
    )
)
CELERY_BROKER_URL = REDIS_URL
CACHES["default"]["LOCATION"] = REDIS_URL
# An unregistered event kind or error code is a bug: raise.
CATACLOUD_STRICT_REGISTRIES = True
