"""The one GitLab call intake may need: a Job event about a job new to us does not say the job's
tags (GitLab's events carry the runner's, not the job's), and the tags choose the runner class.
The webhook answers first; this task looks the job up (``GET /projects/:id/jobs/:job_id``:
``tag_list``), then the core acts on the stored event with it. While GitLab fails, the event
stays stored and the reaper's rule sends this again; the reconciler's poll finds the job too."""

from __future__ import annotations

import logging
from typing import Any

from apps.ci import intake
from apps.ci.errors import ForgeError, ForgeNotFound
from apps.gitlab.client import GitLabClient
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import GitLabDelivery
from apps.gitlab.ops import job_known

log = logging.getLogger(__name__)


def delivery_resolve(*, key: str) -> str:
    delivery = (
        GitLabDelivery.objects.select_related("connection").filter(pk=key, processed_at__isnull=True).first()
    )
    if delivery is None:
        return "done"
    payload: dict[str, Any] = delivery.payload
    try:
        project_id, job_id = int(payload["project_id"]), int(payload["build_id"])
    except (KeyError, TypeError, ValueError):
        return intake.delivery_process(forge=GITLAB, key=key, hint={})
    if job_known(delivery.connection, job_id):
        # another event of the job was resolved meanwhile: its class is chosen, no call needed
        return intake.delivery_process(forge=GITLAB, key=key, hint={})
    try:
        job = GitLabClient(delivery.connection).job(project_id, job_id, background=False)
    except ForgeNotFound:
        hint: dict[str, Any] = {}  # gone already: no tags, no class
    except ForgeError as exc:
        log.info("GitLab job %s not looked up (%s); the event waits", job_id, exc.detail)
        return "waiting"
    else:
        hint = {"tag_list": list(job.tags)}
    return intake.delivery_process(forge=GITLAB, key=key, hint=hint)
