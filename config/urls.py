from __future__ import annotations

from functools import partial

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from apps.control.agent.urls import agent_urls
from apps.control.menu import console_app_list
from apps.control.views import console_login, console_urls
from apps.core.views import healthz, livez, metrics_view, readyz
from apps.github.webhooks import webhook as github_webhook
from apps.gitlab.webhooks import webhook as gitlab_webhook

admin.site.site_header = "Catacloud operator console"
admin.site.site_title = "Catacloud"
admin.site.index_title = "Fleet, jobs, costs, CI and access"
# The lists need the width on a laptop (1366 px): the filters stay on the right, the models are
# one click away on the index ("Home") and the dashboard is in the header.
admin.site.enable_nav_sidebar = False
# No "View site": the console is the site ("/" leads to it).
admin.site.site_url = None
# The home page groups the models as an operator looks for them (apps/control/menu.py).
admin.site.get_app_list = partial(console_app_list, admin.site)  # type: ignore[method-assign]

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),  # the console
    path("admin/dashboard/", include(console_urls())),
    path("admin/login/", console_login, name="console-login"),  # lands on the dashboard
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("livez", livez, name="livez"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/v1/", include("config.api_urls")),
    path("api/integrations/github/webhook", github_webhook, name="github-webhook"),
    path("api/integrations/gitlab/webhook", gitlab_webhook, name="gitlab-webhook"),
    path("api/agent/v1/", include(agent_urls())),
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path(
        "api/redoc/",
        SpectacularRedocView.as_view(url_name="schema", template_name="core/redoc.html"),
        name="redoc",
    ),
]

handler404 = "apps.core.views.not_found"
handler500 = "apps.core.views.server_error"
