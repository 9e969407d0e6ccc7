"""``POST /api/integrations/github/webhook``: GitHub's deliveries.

No API token: the signature is the credential. In order, and writing nothing until the last
step: the size (413), the content type (415), ``X-Hub-Signature-256`` checked against the
raw body with HMAC-SHA256 in constant time (401 ``invalid_signature``) for the connections
of the App the delivery names (``X-GitHub-Hook-Installation-Target-ID``; every connection when
it names none), the headers (400), the JSON (400 ``parse_error``). A delivery for an
installation no organization connected (through a connection whose secret signed it) is
answered 202 and ignored. Otherwise it is stored, keyed by ``X-GitHub-Delivery`` (a
redelivery is a no-op), then acted on in a second transaction, and answered before any
GitHub call (GitHub waits 10 s and never retries by itself). A delivery stored but not acted
on (a crash between the two) is acted on by the reconciler.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from apps.core.errors import ErrorCode, error_payload
from apps.github.demand import workflow_job_apply
from apps.github.models import GitHubConnection, GitHubInstallation, WebhookDelivery

log = logging.getLogger(__name__)
SIGNATURE = re.compile(r"^sha256=([0-9a-f]{64})$")
GUID = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def sign(secret: str, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value GitHub sends for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signature_valid(secret: str, body: bytes, header: str) -> bool:
    """Constant-time check of ``header`` against the HMAC-SHA256 of the raw ``body``."""
    if not secret or not SIGNATURE.match(header or ""):
        return False
    return hmac.compare_digest(sign(secret, body), header)


def _error(status: int, code: ErrorCode, detail: str) -> JsonResponse:
    return JsonResponse(error_payload(code, detail), status=status)


def _candidates(request: HttpRequest) -> list[GitHubConnection]:
    target = request.headers.get("X-GitHub-Hook-Installation-Target-ID", "")
    connections = GitHubConnection.objects.all()
    if target.isdigit() and request.headers.get("X-GitHub-Hook-Installation-Target-Type", "integration") in (
        "integration",
        "",
    ):
        connections = connections.filter(app_id=int(target))
    return list(connections)


@csrf_exempt
def webhook(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        response = _error(405, ErrorCode.METHOD_NOT_ALLOWED, f'Method "{request.method}" not allowed.')
        response["Allow"] = "POST"
        return response
    limit = settings.CATACLOUD_GITHUB_WEBHOOK_MAX_BYTES
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return _error(400, ErrorCode.INVALID, "Content-Length is not a number")
    if declared > limit:
        return _error(413, ErrorCode.PAYLOAD_TOO_LARGE, f"a delivery may have at most {limit} bytes")
    content_type = request.content_type or ""
    if content_type != "application/json":
        return _error(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            "deliveries must be application/json (the webhook's content type)",
        )
    body = request.body
    if len(body) > limit:
        return _error(413, ErrorCode.PAYLOAD_TOO_LARGE, f"a delivery may have at most {limit} bytes")
    header = request.headers.get("X-Hub-Signature-256", "")
    if not header:
        return _error(
            401, ErrorCode.INVALID_SIGNATURE, "X-Hub-Signature-256 is missing: deliveries must be signed"
        )
    verified = [c for c in _candidates(request) if signature_valid(c.webhook_secret, body, header)]
    if not verified:
        return _error(
            401, ErrorCode.INVALID_SIGNATURE, "X-Hub-Signature-256 does not match any connected App's secret"
        )
    event = request.headers.get("X-GitHub-Event", "")
    guid = request.headers.get("X-GitHub-Delivery", "")
    if not event or not GUID.match(guid):
        return _error(400, ErrorCode.INVALID, "X-GitHub-Event and X-GitHub-Delivery are required")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _error(400, ErrorCode.PARSE_ERROR, "the delivery is not valid JSON")
    if not isinstance(payload, dict):
        return _error(400, ErrorCode.PARSE_ERROR, "the delivery must be a JSON object")
    installation_id = (
        (payload.get("installation") or {}).get("id")
        if isinstance(payload.get("installation"), dict)
        else None
    )
    if event == "ping":
        return JsonResponse({"status": "pong"})
    installation = (
        GitHubInstallation.objects.filter(connection__in=verified, installation_id=installation_id)
        .select_related("connection")
        .first()
        if isinstance(installation_id, int)
        else None
    )
    if installation is None:
        return JsonResponse(
            {"status": "ignored", "detail": "no organization connected this installation"}, status=202
        )
    action = str(payload.get("action") or "")[:64]
    try:
        with transaction.atomic():
            WebhookDelivery.objects.create(
                guid=guid,
                installation=installation,
                org_id=installation.org_id,
                event=event[:64],
                action=action,
                payload=payload,
            )
    except IntegrityError:
        return JsonResponse({"status": "duplicate"})
    try:
        outcome = delivery_process(guid=guid)
    except Exception:  # stored: the reconciler acts on it; GitHub must not see a failure
        log.exception("delivery %s stored but not processed (the reconciler will)", guid)
        outcome = "stored"
    return JsonResponse({"status": outcome}, status=200)


def delivery_process(*, guid: str) -> str:
    """Act on a stored delivery once (a delivery being processed elsewhere is skipped)."""
    with transaction.atomic():
        delivery = (
            WebhookDelivery.objects.select_for_update(skip_locked=True, no_key=True)
            .select_related("installation")
            .filter(guid=guid, processed_at__isnull=True)
            .first()
        )
        if delivery is None:
            return "done"
        outcome = _act(delivery)
        WebhookDelivery.objects.filter(pk=guid).update(processed_at=timezone.now(), outcome=outcome[:200])
    return outcome


def _act(delivery: WebhookDelivery) -> str:
    payload: dict[str, Any] = delivery.payload
    installation = delivery.installation
    _learn_account(installation, payload)
    if delivery.event != "workflow_job":
        return "ignored"
    job = payload.get("workflow_job")
    repository = (
        (payload.get("repository") or {}).get("full_name", "")
        if isinstance(payload.get("repository"), dict)
        else ""
    )
    if not isinstance(job, dict) or not repository:
        return "ignored: no workflow_job"
    _, outcome = workflow_job_apply(
        installation=installation,
        job=job,
        status=delivery.action or None,
        repository=str(repository),
        source="webhook",
    )
    return outcome


def _learn_account(installation: GitHubInstallation, payload: dict[str, Any]) -> None:
    """The account an installation is on (where organization runners register), from the first
    delivery that names it."""
    if installation.account:
        return
    org = payload.get("organization")
    repo = payload.get("repository")
    login = ""
    if isinstance(org, dict):
        login = str(org.get("login") or "")
    elif isinstance(repo, dict) and isinstance(repo.get("owner"), dict):
        login = str(repo["owner"].get("login") or "")
    if login:
        GitHubInstallation.objects.filter(pk=installation.pk, account="").update(account=login[:100])
        installation.account = login[:100]


def deliveries_process(*, older_than_seconds: float = 5.0, limit: int = 200) -> int:
    """Deliveries stored but never acted on (their request crashed in between)."""
    cutoff = timezone.now() - timedelta(seconds=older_than_seconds)
    guids = list(
        WebhookDelivery.objects.filter(processed_at__isnull=True, received_at__lt=cutoff)
        .order_by("received_at")
        .values_list("guid", flat=True)[:limit]
    )
    for guid in guids:
        delivery_process(guid=guid)
    return len(guids)
