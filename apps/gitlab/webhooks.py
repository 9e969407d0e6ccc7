"""``POST /api/integrations/gitlab/webhook``: GitLab's Job events (a project's or a group's
webhook with *Job events* on, its *Secret token* the connection's ``webhook_token``).

No API token: the secret token is the credential. In order, and writing nothing until the last
step: the method (405), the size (413), the content type (415), ``X-Gitlab-Token`` compared in
constant time with every connection's (of the GitLab instance the delivery names, when it names
one: ``X-Gitlab-Instance``) (401 ``invalid_signature``), the headers (400: ``X-Gitlab-Event`` and
an idempotency key, ``Idempotency-Key`` or else ``X-Gitlab-Event-UUID``), the JSON (400
``parse_error``). An event that is not a Job event, or for a project no connection whose token
it carries lists, is answered 202 and ignored. Otherwise it is stored by its idempotency key
(the same event sent again is a no-op), acted on in a second transaction, and answered before
any call to GitLab (a job new to us whose tags the event lacks is looked up by a task): the CI
core's intake (apps.ci.intake).
"""

from __future__ import annotations

import hmac
import re

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.ci import intake
from apps.ci.intake import error
from apps.core.errors import ErrorCode
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import GitLabConnection, GitLabProject

KEY = re.compile(r"^[A-Za-z0-9-]{1,64}$")
JOB_HOOK = "Job Hook"


def token_valid(expected: str, given: str) -> bool:
    """Constant-time comparison of the delivery's ``X-Gitlab-Token`` with a connection's."""
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def _candidates(request: HttpRequest) -> list[GitLabConnection]:
    connections = list(GitLabConnection.objects.all())
    instance = request.headers.get("X-Gitlab-Instance", "").rstrip("/")
    named = [c for c in connections if c.url.rstrip("/") == instance]
    return named or connections


@csrf_exempt
def webhook(request: HttpRequest) -> JsonResponse:
    body = intake.read_body(request, limit=settings.CATACLOUD_GITLAB_WEBHOOK_MAX_BYTES)
    if isinstance(body, JsonResponse):
        return body
    given = request.headers.get("X-Gitlab-Token", "")
    if not given:
        return error(
            401, ErrorCode.INVALID_SIGNATURE, "X-Gitlab-Token is missing: set the webhook's secret token"
        )
    verified = [c for c in _candidates(request) if token_valid(c.webhook_token, given)]
    if not verified:
        return error(
            401, ErrorCode.INVALID_SIGNATURE, "X-Gitlab-Token does not match any connection's secret token"
        )
    event = request.headers.get("X-Gitlab-Event", "")
    key = request.headers.get("Idempotency-Key") or request.headers.get("X-Gitlab-Event-UUID", "")
    if not event or not KEY.match(key):
        return error(
            400, ErrorCode.INVALID, "X-Gitlab-Event and Idempotency-Key (or X-Gitlab-Event-UUID) are required"
        )
    payload = intake.read_json(body)
    if isinstance(payload, JsonResponse):
        return payload
    if event != JOB_HOOK or payload.get("object_kind") != "build":
        return JsonResponse({"status": "ignored", "detail": "only Job events are acted on"}, status=202)
    project_id = payload.get("project_id")
    project = (
        GitLabProject.objects.filter(connection__in=verified, project_id=project_id)
        .select_related("connection")
        .first()
        if isinstance(project_id, int) and not isinstance(project_id, bool)
        else None
    )
    if project is None:
        return JsonResponse(
            {"status": "ignored", "detail": "no organization connected this project"}, status=202
        )
    return intake.delivery_received(
        forge=GITLAB,
        key=key,
        endpoint=project.connection,
        event=event,
        action=str(payload.get("build_status") or ""),
        payload=payload,
    )
