"""URL assembly for the surfaces that span apps: the Agent API (machine and job endpoints)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, path

from apps.jobs.agent import job_agent_urls
from apps.machines.agent_api import machine_agent_urls


def agent_urls() -> list:
    """The hot endpoints (heartbeat, work) are async views of this app; the rest are the apps'
    DRF views, which the agent server runs on its database threads (see :func:`on_db_threads`)."""
    from apps.control.agent.views import heartbeat, work

    rest = machine_agent_urls() + job_agent_urls()
    if settings.CATACLOUD_AGENT_SERVER:
        rest = [on_db_threads(pattern) for pattern in rest]
    return [
        path("heartbeat", heartbeat, name="agent-heartbeat"),
        path("work", work, name="agent-work"),
        *rest,
    ]


def on_db_threads(pattern: URLPattern) -> URLPattern:
    """A synchronous view as an async one that runs (and renders) on the agent server's database
    threads, so no request gets a thread of its own and connections stay persistent."""
    from apps.control.agent import db

    view = pattern.callback

    def call(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = view(request, *args, **kwargs)
        if callable(getattr(response, "render", None)) and not getattr(response, "is_rendered", True):
            response.render()
        return response

    async def async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return await db.run(call, request, *args, **kwargs)

    async_view.csrf_exempt = True  # type: ignore[attr-defined]  # token-authenticated, like the DRF views
    return URLPattern(pattern.pattern, async_view, pattern.default_args, pattern.name)
