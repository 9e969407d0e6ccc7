"""The one GitLab call intake may need: a Job event about a job new to us does not say the job's
tags (GitLab's events carry the runner's, not the job's), and the tags choose the runner class;
nor does an event say which runner manager of a class runner took the job (the jobs API does).
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
from apps.gitlab.runners import is_class_runner

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
    runner_id = (payload.get("runner") or {}).get("id") if isinstance(payload.get("runner"), dict) else None
    manager_needed = isinstance(runner_id, int) and is_class_runner(runner_id)
    if job_known(delivery.connection, job_id) and not manager_needed:
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
        # the tags choose the class; a class runner's job names which of its machines took it
        hint = {"tag_list": list(job.tags), "runner_manager": job.runner_manager}
    return intake.delivery_process(forge=GITLAB, key=key, hint=hint)
