"""The Agent API's DRF endpoints (everything but the hot heartbeat, long poll and job start, which are
:mod:`apps.control.agent.views`): thin views that read the request, call one service of
``machines`` (enrolment) or ``jobs`` (a job's reports, logs, resources, outputs) and answer.
Every job call is checked against the calling machine by the service: a job that is not (or no
longer) assigned to it answers 409 and its reports change nothing."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.validators import ProhibitNullCharactersValidator
from django.http import StreamingHttpResponse
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.control.agent.auth import AgentView
from apps.core.errors import Conflict, ErrorCode, LengthRequired, UpgradeRequired, ValidationFailed
from apps.core.ids import JobId
from apps.jobs.artifacts import (
    artifact_upload,
    checkpoint_restore,
    clean_name,
    job_for_upload,
    masked_name,
    uploads_done,
)
from apps.jobs.models import Artifact, Job
from apps.jobs.reports import (
    held_for_uploads,
    job_finished,
    job_image_report,
    job_interrupted,
    job_logs_append,
    job_resource_metadata,
)
from apps.jobs.selectors import image_pull
from apps.machines.agents import agent_enroll, agent_settings, instance_images_report
from apps.pools.services import pool_member_enrolled
from catacloud.protocol import (
    OLDEST_AGENT,
    Enroll,
    EnrollAnswer,
    FinishedAnswer,
    ImagesReport,
    Outcome,
    Stream,
)
from catacloud.protocol import VERSION as PROTOCOL_VERSION

# ---- enroll ------------------------------------------------------------------------------------


class EnrollIn(serializers.Serializer):
    """The bounds of what an enrollment may carry; its shape is catacloud.protocol's Enroll."""

    bootstrap_token = serializers.CharField(max_length=200)
    hostname = serializers.CharField(max_length=200, required=False, allow_blank=True)
    agent_version = serializers.CharField(max_length=50, required=False, allow_blank=True)
    protocol = serializers.IntegerField(min_value=0, required=False)
    machine = serializers.JSONField(required=False)


class EnrollView(APIView):
    """Exchange the single-use bootstrap token for this instance's agent token."""

    schema = None
    authentication_classes: list = []
    permission_classes: list = []
    throttle_classes: list = []

    def post(self, request: Request) -> Response:
        data = EnrollIn(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            enroll = Enroll.from_json(data.validated_data)
        except ValueError as exc:
            raise ValidationFailed(f"machine: {exc}") from None
        if enroll.protocol < OLDEST_AGENT:
            raise UpgradeRequired(
                f"this agent speaks protocol {enroll.protocol}; this control plane needs "
                f"{OLDEST_AGENT} or later (it speaks {PROTOCOL_VERSION}): upgrade catacloud-agent "
                "on the machine image (pip install --upgrade catacloud-agent)"
            )
        instance, secret = agent_enroll(
            bootstrap_token=enroll.bootstrap_token,
            hostname=enroll.hostname,
            agent_version=enroll.agent_version,
            machine=enroll.machine,
        )
        # A pool member pulls its pool's images before the handshake that makes it ready.
        images = pool_member_enrolled(instance_id=instance.pk)
        answer = EnrollAnswer(
            instance_id=str(instance.pk),
            agent_token=secret,
            **agent_settings(),
            image_store_bytes=instance.machine_type.image_cache_mb * 10**6,
            images=tuple(image_pull(org_id=instance.org_id, reference=ref) for ref in images),
        )
        return Response(answer.to_json())


def _images_report(request: Request) -> ImagesReport:
    if not isinstance(request.data, dict):
        raise ValidationFailed("the body must be a JSON object")
    try:
        return ImagesReport.from_json(request.data)
    except ValueError as exc:
        raise ValidationFailed(str(exc)) from None


class ImagesView(AgentView):
    """A pool member's images, pulled before it became ready, and what its store holds."""

    def post(self, request: Request) -> Response:
        instance_images_report(instance=self.instance, report=_images_report(request))
        return Response({"ok": True})


class JobImageView(AgentView):
    """The job's image: pulled or found on the machine, and its digest."""

    def post(self, request: Request, job_id: JobId) -> Response:
        job_image_report(instance=self.instance, job_id=job_id, report=_images_report(request))
        return Response({"ok": True})


# ---- a job's reports ---------------------------------------------------------------------------


class OutputText(serializers.CharField):
    """A job's output as it came: NUL characters too (binary output has them; DRF's CharField
    refuses them, which refused the whole chunk and left the agent retrying it until its report's
    deadline). They are stored as U+FFFD (PostgreSQL's text cannot hold NUL)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validators = [v for v in self.validators if not isinstance(v, ProhibitNullCharactersValidator)]


class ChunkIn(serializers.Serializer):
    seq = serializers.IntegerField(min_value=0)
    stream = serializers.ChoiceField(choices=[s.value for s in Stream])
    data = OutputText(  # type: ignore[assignment]  # the chunk's text, not Serializer.data
        allow_blank=True, trim_whitespace=False, max_length=1_000_000
    )


class LogsIn(serializers.Serializer):
    chunks = ChunkIn(many=True)


class LogsView(AgentView):
    def post(self, request: Request, job_id: JobId) -> Response:
        body = LogsIn(data=request.data)
        body.is_valid(raise_exception=True)
        cancel = job_logs_append(instance=self.instance, job_id=job_id, chunks=body.validated_data["chunks"])
        return Response({"cancel": cancel})


class FinishedIn(serializers.Serializer):
    exit_code = serializers.IntegerField(allow_null=True, required=False)
    uploads_pending = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    outcome = serializers.ChoiceField(choices=[o.value for o in Outcome])
    reason = serializers.CharField(allow_blank=True, required=False, default="", max_length=2000)
    code = serializers.CharField(allow_blank=True, required=False, default="", max_length=32)
    launch_ms = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=86_400_000)
    network = serializers.ChoiceField(
        choices=["ahead", "at start", "none"], required=False, allow_blank=True, default=""
    )
    output = ChunkIn(many=True, required=False)  # the job's last output (its payload's final_output)


class FinishedView(AgentView):
    def post(self, request: Request, job_id: JobId) -> Response:
        body = FinishedIn(data=request.data)
        body.is_valid(raise_exception=True)
        job = job_finished(
            instance=self.instance,
            job_id=job_id,
            outcome=Outcome(body.validated_data["outcome"]),
            exit_code=body.validated_data.get("exit_code"),
            reason=body.validated_data["reason"],
            uploads_pending=body.validated_data.get("uploads_pending"),
            code=body.validated_data["code"],
            output=body.validated_data.get("output", ()),
            launch={
                k: body.validated_data[k]
                for k in ("launch_ms", "network")
                if body.validated_data.get(k) not in (None, "")
            },
        )
        awaits = held_for_uploads(body.validated_data.get("uploads_pending"))
        return Response(FinishedAnswer(status=job.status, awaits_uploads=awaits).to_json())


class MetaView(AgentView):
    """Metadata of a resource the running job holds (``catacloud job-meta NAME``)."""

    def get(self, request: Request, job_id: JobId, name: str) -> Response:
        metadata = job_resource_metadata(instance=self.instance, job_id=job_id, name=name)
        return Response({"name": name, "metadata": metadata})


class InterruptionIn(serializers.Serializer):
    kind = serializers.CharField(max_length=32)
    detail = serializers.CharField(allow_blank=True, required=False, default="", max_length=4000)


class InterruptionView(AgentView):
    def post(self, request: Request) -> Response:
        body = InterruptionIn(data=request.data)
        body.is_valid(raise_exception=True)
        job_interrupted(
            instance=self.instance, detail=f"{body.validated_data['kind']}: {body.validated_data['detail']}"
        )
        return Response({"ok": True})


# ---- outputs and checkpoints -------------------------------------------------------------------


def _upload(request: Request, job: Job, kind: str, name: str) -> Response:
    """The raw body as ``job``'s artifact, its size and SHA-256 announced in the headers."""
    try:
        size = int(request.headers.get("Content-Length", ""))
    except ValueError:
        raise LengthRequired("Content-Length is required") from None
    sha256 = request.headers.get("X-Checksum-Sha256", "")
    if len(sha256) != 64:
        raise ValidationFailed("X-Checksum-Sha256 (hex SHA-256 of the body) is required")
    artifact = artifact_upload(job=job, kind=kind, name=name, body=request._request, size=size, sha256=sha256)
    return Response({"name": artifact.name, "size": artifact.size, "sha256": artifact.sha256}, status=201)


class ArtifactUploadView(AgentView):
    parser_classes: list = []  # the body is the file: read it raw, never parse it

    def put(self, request: Request, job_id: str, name: str) -> Response:
        clean = clean_name(name)
        if clean is None:
            raise ValidationFailed("not a safe relative file name")
        job = job_for_upload(self.instance, UUID(job_id), live_only=False)  # the URL's pattern: a UUID
        if job is None:
            raise Conflict(
                "this job's outputs are no longer accepted from this machine", code=ErrorCode.NOT_ASSIGNED
            )
        return _upload(request, job, Artifact.KIND_OUTPUT, masked_name(job, clean))


def _running_job(view: AgentView, job_id: JobId) -> Job:
    job = job_for_upload(view.instance, job_id, live_only=True)
    if job is None:
        raise Conflict("this job is not (or no longer) running on this machine", code=ErrorCode.NOT_ASSIGNED)
    return job


class CheckpointView(AgentView):
    parser_classes: list = []

    def put(self, request: Request, job_id: JobId) -> Response:
        return _upload(request, _running_job(self, job_id), Artifact.KIND_CHECKPOINT, "checkpoint.tar.gz")

    def get(self, request: Request, job_id: JobId) -> Any:
        artifact, chunks = checkpoint_restore(instance=self.instance, job=_running_job(self, job_id))
        response = StreamingHttpResponse(chunks, content_type="application/gzip")
        response["Content-Length"] = str(artifact.size)
        response["X-Checksum-Sha256"] = artifact.sha256
        return response


class UploadsDoneView(AgentView):
    def post(self, request: Request, job_id: JobId) -> Response:
        failed = request.data.get("failed") or [] if isinstance(request.data, dict) else []
        uploads_done(instance=self.instance, job_id=job_id, failed=failed)
        return Response({"ok": True})
