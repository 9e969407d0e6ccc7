"""Job outputs and checkpoints: files that outlive the machine.

The agent uploads through the Agent API (so machines hold no storage credentials); the
server checks each upload's size and SHA-256 while spooling it, then writes it to the store
under ``<org>/<job>/…``. Outputs are uploaded after the job's exit report (which they never
block); the machine is released only when the agent says its uploads are done. The latest
checkpoint is restored into a requeued attempt before its command starts.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import tempfile
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import HttpResponseRedirect, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.errors import Conflict, ErrorCode, NotFound, ValidationFailed
from apps.core.ids import JobId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.jobs.choices import JOB_TERMINAL, ArtifactStatus, JobStatus
from apps.jobs.models import Artifact, Job
from apps.jobs.reports import instance_release
from apps.jobs.services import job_claim_label
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance
from catacloud.agent.masking import mask_text
from catacloud.protocol import Checkpoint
from catacloud.storage import LocalStore, Readable, S3Store, Store, bad_segment

log = logging.getLogger(__name__)
MAX_NAME = 900  # bytes: with <org>/<job>/outputs/ it stays under S3's 1024-byte keys


@functools.cache
def get_store() -> Store:
    if settings.CATACLOUD_STORAGE == "s3":
        return S3Store(
            bucket=settings.CATACLOUD_S3_BUCKET,
            prefix=settings.CATACLOUD_S3_PREFIX,
            endpoint_url=settings.CATACLOUD_S3_ENDPOINT_URL or None,
            region=settings.CATACLOUD_S3_REGION or None,
            access_key_id=settings.CATACLOUD_S3_ACCESS_KEY_ID or None,
            secret_access_key=settings.CATACLOUD_S3_SECRET_ACCESS_KEY or None,
            multipart_mb=settings.CATACLOUD_S3_MULTIPART_MB,
            presign=settings.CATACLOUD_S3_PRESIGN,
        )
    return LocalStore(settings.CATACLOUD_STORAGE_DIR)


def artifact_key(job: Job, kind: str, name: str) -> str:
    if kind == Artifact.KIND_CHECKPOINT:
        return f"{job.org_id}/{job.pk}/checkpoint.tar.gz"
    return f"{job.org_id}/{job.pk}/outputs/{name}"


def clean_name(raw: str) -> str | None:
    """A safe relative path (``reports/junit.xml``), or None.

    ``raw`` is already decoded (the URL path was percent-decoded once, by the server). It is
    never decoded again: a second decoding is what turned ``a%252F..`` into ``a/..`` after
    the check. Every ``/``-separated part is then checked (no ``.``/``..``, separators,
    control characters or NUL; at most 255 bytes) and the whole name is bounded.
    """
    parts = raw.split("/")
    if any(bad_segment(part) is not None for part in parts):
        return None
    return raw if len(raw.encode("utf-8", "surrogatepass")) <= MAX_NAME else None


class BadUpload(Exception):
    pass


def spool_verified(stream: Readable, *, size: int, sha256: str) -> tempfile.SpooledTemporaryFile[bytes]:
    """Copy the request body to a spooled temp file, checking its size and SHA-256."""
    digest = hashlib.sha256()
    spool = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)  # noqa: SIM115 - returned open
    received = 0
    while block := stream.read(1024 * 1024):
        received += len(block)
        if received > size:
            break
        digest.update(block)
        spool.write(block)
    if received != size or digest.hexdigest() != sha256.lower():
        spool.close()
        raise BadUpload(f"received {received} bytes with another checksum than announced")
    spool.seek(0)
    return spool


def artifact_store(*, job: Job, kind: str, name: str, body: Readable, size: int, sha256: str) -> Artifact:
    """Verify and store one upload (no transaction open during the store write), then record it."""
    spool = spool_verified(body, size=size, sha256=sha256)
    key = artifact_key(job, kind, name)
    try:
        get_store().put(key, spool, size=size)
    finally:
        spool.close()
    days = job.config.artifact_retention_days
    expires = timezone.now() + timedelta(days=days) if days else None
    with transaction.atomic():
        artifact, _ = Artifact.objects.update_or_create(
            job=job,
            kind=kind,
            name=name,
            defaults={
                "org_id": job.org_id,
                "size": size,
                "sha256": sha256.lower(),
                "key": key,
                "status": ArtifactStatus.STORED,
                "error": "",
                "attempt": job.attempt,
                "expires_at": expires,
            },
        )
        event_record(
            kind=EventKind.CHECKPOINT_SAVED
            if kind == Artifact.KIND_CHECKPOINT
            else EventKind.ARTIFACT_STORED,
            org=job.org_id,
            job=job,
            actor=Actor.AGENT,
            name=name,
            size=size,
            attempt=job.attempt,
        )
    return artifact


def artifacts_expire(*, now: datetime | None = None, limit: int = 500) -> int:
    """Retention: delete expired outputs and checkpoints from the store and record it."""
    now = now or timezone.now()
    count = 0
    for artifact in Artifact.objects.filter(status=ArtifactStatus.STORED, expires_at__lt=now)[:limit]:
        try:
            get_store().delete(artifact.key)
        except Exception as exc:
            log.warning("could not delete expired artifact %s: %s", artifact.pk, type(exc).__name__)
            continue
        with transaction.atomic():
            Artifact.objects.filter(pk=artifact.pk).update(status=ArtifactStatus.EXPIRED)
            event_record(
                kind=EventKind.ARTIFACT_EXPIRED,
                org=artifact.org_id,
                job=artifact.job_id,
                actor=Actor.REAPER,
                name=artifact.name,
                kind_=artifact.kind,
            )
        count += 1
    return count


def stored_checkpoint(job: Any) -> Any:
    """The job's stored checkpoint (``job``: a job, or ``OuterRef("pk")`` in a query of jobs)."""
    return Artifact.objects.filter(job=job, kind=Artifact.KIND_CHECKPOINT, status=ArtifactStatus.STORED)


def checkpoint_info(job: Job, *, available: bool | None = None) -> Checkpoint:
    """``available``: known already (the statement that loaded the job asked), else asked now."""
    return Checkpoint(
        available=stored_checkpoint(job).exists() if available is None else available,
        interval_seconds=job.config.checkpoint_interval_seconds,
    )


# ---- what the Agent API (apps/control/agent/) calls ---------------------------------------------


def masked_name(job: Job, name: str) -> str:
    """A name the job chose, with its secret env values masked (viewers list outputs but may
    not read env): the same forms as in its output (catacloud/agent/masking.py)."""
    secrets = job.all_secret_env()
    return mask_text(name, secrets.values()) if secrets else name


def job_for_upload(instance: MachineInstance, job_id: JobId, *, live_only: bool) -> Job | None:
    """The job may still be uploading if it runs on this machine, or (outputs) if it ended
    and the machine is still held for it (the server waits for uploads-done)."""
    job = Job.objects.select_related("config").filter(pk=job_id, instance=instance).first()
    if job is None:
        return None
    if job.status in (JobStatus.ASSIGNED, JobStatus.RUNNING):
        return job
    if live_only or job.status not in JOB_TERMINAL:
        return None
    held = MachineInstance.objects.filter(
        pk=instance.pk, status=InstanceStatus.CLAIMED, claimed_for=job_claim_label(job.pk)
    ).exists()
    return job if held else None


def artifact_upload(*, job: Job, kind: str, name: str, body: Readable, size: int, sha256: str) -> Artifact:
    """An agent's upload for ``job`` (found by :func:`job_for_upload`): stored, or 400
    ``checksum_mismatch`` when the body is not what its size and SHA-256 announced."""
    try:
        return artifact_store(job=job, kind=kind, name=name, body=body, size=size, sha256=sha256)
    except BadUpload as exc:
        raise ValidationFailed(str(exc), code=ErrorCode.CHECKSUM_MISMATCH) from None


def checkpoint_restore(*, instance: MachineInstance, job: Job) -> tuple[Artifact, Iterator[bytes]]:
    """The latest checkpoint of ``job`` for its agent to restore before a requeued attempt
    starts (404 when it has none or the file is gone), recorded as ``checkpoint.restored``."""
    artifact = Artifact.objects.filter(
        job=job, kind=Artifact.KIND_CHECKPOINT, status=ArtifactStatus.STORED
    ).first()
    if artifact is None:
        raise NotFound("this job has no checkpoint")
    try:
        chunks = get_store().open(artifact.key)
    except FileNotFoundError:
        raise NotFound("the checkpoint is gone from the store") from None
    event_record(
        kind=EventKind.CHECKPOINT_RESTORED,
        org=job.org_id,
        job=job,
        actor=Actor.agent(instance.pk),
        attempt=job.attempt,
        from_attempt=artifact.attempt,
    )
    return artifact, chunks


def uploads_done(*, instance: MachineInstance, job_id: JobId, failed: list[Any]) -> None:
    """The agent finished uploading ``job_id``'s outputs: record the ones it could not upload
    (``failed``: ``{name, error}`` items, names masked like the job's output) and, the job
    having ended, release the machine held for them."""
    job = Job.objects.select_related("config").filter(pk=job_id, instance=instance).first()
    if job is None:
        raise Conflict("this job did not run on this machine", code=ErrorCode.NOT_ASSIGNED)
    with transaction.atomic():
        for item in failed[:1000]:
            name = clean_name(str(item.get("name", ""))) if isinstance(item, dict) else None
            if name is None:
                continue
            name = masked_name(job, name)
            error = masked_name(job, str(item.get("error", ""))[:2000])  # it may quote the name
            Artifact.objects.update_or_create(
                job=job,
                kind=Artifact.KIND_OUTPUT,
                name=name,
                defaults={
                    "org_id": job.org_id,
                    "status": ArtifactStatus.FAILED,
                    "error": error,
                    "key": "",
                    "attempt": job.attempt,
                },
            )
            event_record(
                kind=EventKind.ARTIFACT_UPLOAD_FAILED,
                org=job.org_id,
                job=job,
                actor=Actor.AGENT,
                name=name,
                reason=error,
            )
        if job.status in JOB_TERMINAL:
            instance_release(instance_id=instance.pk, job=job)


def artifact_download(artifact: Artifact) -> HttpResponseBase:
    """A stored output as a download: a redirect to a short-lived presigned URL (S3), or the
    file streamed with its size and checksum. The file gone from the store: 404."""
    store = get_store()
    filename = artifact.name.rsplit("/", 1)[-1].replace('"', "")
    url = store.url(artifact.key, expires_seconds=300, filename=filename)
    if url:
        return HttpResponseRedirect(url)
    try:
        chunks = store.open(artifact.key)
    except FileNotFoundError:
        raise NotFound("the artifact is gone from the store") from None
    response = StreamingHttpResponse(chunks, content_type="application/octet-stream")
    response["Content-Length"] = str(artifact.size)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["X-Checksum-Sha256"] = artifact.sha256
    return response
