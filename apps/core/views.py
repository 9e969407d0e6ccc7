from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from apps.core import health, metrics


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    code, body = health.health()
    return JsonResponse(body, status=code)


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    body, content_type = metrics.render()
    return HttpResponse(body, content_type=content_type)
