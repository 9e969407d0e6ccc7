"""The agent server: the Agent API as an ASGI application (``catacloud agent-server`` runs it
under uvicorn; ``uvicorn config.agent_asgi:application`` elsewhere).

One event loop holds every waiting long poll: a poll costs a socket and a few objects, not a
thread or a database connection. Queries run on ``CATACLOUD_AGENT_DB_THREADS`` threads with
persistent connections (apps.control.agent.db); wake-ups come over one Redis pub/sub
connection (apps.control.agent.wakeups). The user API and the admin stay on the WSGI web.
"""

from __future__ import annotations

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


application = AgentServer()

from django.conf import settings  # noqa: E402

from apps.control.agent import db, wakeups  # noqa: E402

# Django closes stale connections at each request's start and end on a thread of the request's
# own (held for as long as the request lasts, i.e. for a whole long poll). Here connections
# belong to the database threads, which check them every few seconds instead.
# (reset_queries too: a sync receiver, so the same thread; it only trims DEBUG's query log.)
signals.request_started.disconnect(close_old_connections)
signals.request_started.disconnect(reset_queries)
signals.request_finished.disconnect(close_old_connections)
db.serve_pooled(settings.CATACLOUD_AGENT_DB_THREADS)
wakeups.serve_shared()
