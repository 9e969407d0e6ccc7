"""The Agent API's URLs (``/api/agent/v1/``), on the web and on the agent server."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, path, re_path

from apps.control.agent import db, endpoints, hosts
from apps.control.agent.views import heartbeat, started, work
from apps.machines.agent_dist import agent_wheel_view, install_host_view
from apps.machines.install_host import SCRIPT_NAME


def agent_urls() -> list[URLPattern]:
    """The hot endpoints (heartbeat, work, a job's start) are async views; the rest are DRF views, which the
    agent server runs on its database threads (see :func:`on_db_threads`)."""
    rest = [
        path("enroll", endpoints.EnrollView.as_view(), name="agent-enroll"),
        path("hosts/enroll", hosts.HostEnrollView.as_view(), name="agent-host-enroll"),
        path(f"dist/{SCRIPT_NAME}", install_host_view, name="agent-install-host"),
        path("dist/<str:filename>", agent_wheel_view, name="agent-wheel"),
        path("jobs/<uuid:job_id>/logs", endpoints.LogsView.as_view(), name="agent-job-logs"),
        path("jobs/<uuid:job_id>/finished", endpoints.FinishedView.as_view(), name="agent-job-finished"),
        path("jobs/<uuid:job_id>/meta/<slug:name>", endpoints.MetaView.as_view(), name="agent-job-meta"),
        path("interruption", endpoints.InterruptionView.as_view(), name="agent-interruption"),
        path("images", endpoints.ImagesView.as_view(), name="agent-images"),
        path("jobs/<uuid:job_id>/image", endpoints.JobImageView.as_view(), name="agent-job-image"),
        re_path(
            # a UUID's own shape (36 characters of hex and dashes is not enough: uuid.UUID()
            # refused it later, a 500); the name is the raw rest of the path (checked once)
            r"^jobs/(?P<job_id>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
            r"/artifacts/(?P<name>.+)$",
            endpoints.ArtifactUploadView.as_view(),
            name="agent-job-artifact",
        ),
        path(
            "jobs/<uuid:job_id>/checkpoint", endpoints.CheckpointView.as_view(), name="agent-job-checkpoint"
        ),
        path(
            "jobs/<uuid:job_id>/uploads-done",
            endpoints.UploadsDoneView.as_view(),
            name="agent-job-uploads-done",
        ),
    ]
    if settings.CATACLOUD_AGENT_SERVER:
        rest = [on_db_threads(pattern) for pattern in rest]
    return [
        path("heartbeat", heartbeat, name="agent-heartbeat"),
        path("work", work, name="agent-work"),
        path("jobs/<uuid:job_id>/started", started, name="agent-job-started"),
        path("hosts/exchange", hosts.exchange, name="agent-host-exchange"),
        *rest,
    ]


def on_db_threads(pattern: URLPattern) -> URLPattern:
    """A synchronous view as an async one that runs (and renders) on the agent server's database
    threads, so no request gets a thread of its own and connections stay persistent."""
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
