"""The agent server: the Agent API as an ASGI application (``catacloud agent-server`` runs it
under uvicorn; ``uvicorn config.agent_asgi:application`` elsewhere).

One event loop holds every waiting long poll: a poll costs a socket and a few objects, not a
thread or a database connection. The two requests every agent makes all day (heartbeat, work)
are answered by a lean ASGI route (apps.control.agent.asgi) whose statements run on a few
asynchronous psycopg connections (``CATACLOUD_AGENT_DB_CONNECTIONS``); everything else goes to
Django, whose ORM calls run on ``CATACLOUD_AGENT_DB_THREADS`` threads with persistent
connections (apps.control.agent.db). Wake-ups come over one Redis pub/sub connection
(apps.control.agent.wakeups). The user API and the admin stay on the WSGI web.
"""

from __future__ import annotations

import gc
import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ["CATACLOUD_AGENT_SERVER"] = "1"

import django
from django.core import signals
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections, reset_queries

django.setup(set_prefix=False)


class AgentServer(ASGIHandler):
    """Django's ASGI handler without its per-request thread: Django gives every request a
    "thread-sensitive context", i.e. a thread of its own created at the request's first
    synchronous step and joined (by yet another thread) at its end. Here every synchronous step
    runs on the database threads (apps.control.agent.db) and the rest (closing a response) on
    asgiref's one shared thread, so a poll or a heartbeat starts no thread."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"the agent server serves HTTP only, not {scope['type']}")
        await self.handle(scope, receive, send)


from django.conf import settings  # noqa: E402

from apps.control.agent import db, wakeups  # noqa: E402
from apps.control.agent.admission import limited  # noqa: E402
from apps.control.agent.asgi import hot_route  # noqa: E402
from apps.core import tracing  # noqa: E402

tracing.setup("agent-server")  # before the handler loads the middleware (Django's instrumentation)

# Each machine within its connection budget (apps.control.agent.limits), then the hot route.
application = limited(hot_route(AgentServer()))

# Django closes stale connections at each request's start and end on a thread of the request's
# own (held for as long as the request lasts, i.e. for a whole long poll). Here connections
# belong to the database threads, which check them every few seconds instead.
# (reset_queries too: a sync receiver, so the same thread; it only trims DEBUG's query log.)
signals.request_started.disconnect(close_old_connections)
signals.request_started.disconnect(reset_queries)
signals.request_finished.disconnect(close_old_connections)
db.serve_pooled(settings.CATACLOUD_AGENT_DB_THREADS, settings.CATACLOUD_AGENT_DB_CONNECTIONS)
wakeups.serve_shared()

# Everything loaded so far (Django, the apps, their modules: most of the process's objects) lives
# as long as the process: out of the collector's sight, a full collection walks only what the
# connections and polls allocate, tens of milliseconds instead of hundreds with a few thousand
# agents connected.
gc.collect()
gc.freeze()
