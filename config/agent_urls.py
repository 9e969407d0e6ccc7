"""The agent server's URLs (``CATACLOUD_AGENT_SERVER``): the Agent API and the health check only."""

from __future__ import annotations

from django.urls import include, path

from apps.control.agent.urls import agent_urls
from apps.core.views import healthz, livez, readyz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("livez", livez, name="livez"),
    path("readyz", readyz, name="readyz"),
    path("api/agent/v1/", include(agent_urls())),
]

handler404 = "apps.core.views.not_found"
handler500 = "apps.core.views.server_error"
