"""The job endpoints of the Agent API: started, logs, finished, meta,
interruption. Every call is checked against the calling machine: a job that is not (or no
longer) assigned to it answers 409 and its reports change nothing."""

from __future__ import annotations

from typing import Any

from django.urls import path
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.errors import Conflict, ErrorCode, NotFound
from apps.core.ids import JobId
from apps.jobs.artifacts import artifact_agent_urls, checkpoint_info
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job, JobLogChunk
from apps.jobs.reports import job_finished, job_interrupted, job_started
from apps.machines.agent_api import AgentView


def _resource_names(job: Job) -> list[str]:
    return list(job.resources.values_list("resource_type_id", flat=True))


def job_payload(job: Job) -> dict[str, Any]:
    """What an agent is handed to run ``job`` (``GET work``): its command, env (secrets on top,
    their names to mask), timeout, attempt, resources and checkpoint."""
    return {
        "id": str(job.pk),
        "command": job.command,
        # Plain env, then the secret values (the configuration's, then the job's own) on top.
        "env": {**job.env, **(secret := job.all_secret_env())},
        # The agent masks these values in the job's output (and its own log).
        "secret_env_names": sorted(secret),
        "timeout_seconds": job.timeout_seconds,
        "attempt": job.attempt,
        "resources": _resource_names(job),
        "checkpoint": checkpoint_info(job),
    }


class StartedView(AgentView):
    def post(self, request: Request, job_id: JobId) -> Response:
        job_started(instance=self.instance, job_id=job_id)
        return Response({"ok": True})


class ChunkIn(serializers.Serializer):
    seq = serializers.IntegerField(min_value=0)
    stream = serializers.ChoiceField(choices=["stdout", "stderr"])
    data = serializers.CharField(  # type: ignore[assignment]  # the chunk's text, not Serializer.data
        allow_blank=True, trim_whitespace=False, max_length=1_000_000
    )


class LogsIn(serializers.Serializer):
    chunks = ChunkIn(many=True)


class LogsView(AgentView):
    def post(self, request: Request, job_id: JobId) -> Response:
        body = LogsIn(data=request.data)
        body.is_valid(raise_exception=True)
        job = Job.objects.filter(
            pk=job_id, instance=self.instance, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING]
        ).first()
        if job is None:
            raise Conflict(
                "this job is not (or no longer) running on this machine", code=ErrorCode.NOT_ASSIGNED
            )
        JobLogChunk.objects.bulk_create(
            [
                JobLogChunk(
                    job=job,
                    attempt=job.attempt,
                    seq=c["seq"],
                    stream=c["stream"],
                    data=c["data"].replace("\x00", "\ufffd"),
                )
                for c in body.validated_data["chunks"]
            ],
            ignore_conflicts=True,  # a retried POST repeats seqs we already have
        )
        return Response({"cancel": job.cancel_requested})


class FinishedIn(serializers.Serializer):
    exit_code = serializers.IntegerField(allow_null=True, required=False)
    uploads_pending = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    outcome = serializers.ChoiceField(choices=["succeeded", "failed", "timed_out", "cancelled"])
    reason = serializers.CharField(allow_blank=True, required=False, default="", max_length=2000)


class FinishedView(AgentView):
    def post(self, request: Request, job_id: JobId) -> Response:
        body = FinishedIn(data=request.data)
        body.is_valid(raise_exception=True)
        job = job_finished(
            instance=self.instance,
            job_id=job_id,
            outcome=body.validated_data["outcome"],
            exit_code=body.validated_data.get("exit_code"),
            reason=body.validated_data["reason"],
            uploads_pending=body.validated_data.get("uploads_pending"),
        )
        return Response({"ok": True, "status": job.status})


class MetaView(AgentView):
    """Metadata of a resource the running job holds (``catacloud job-meta NAME``)."""

    def get(self, request: Request, job_id: JobId, name: str) -> Response:
        job = Job.objects.filter(
            pk=job_id, instance=self.instance, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING]
        ).first()
        if job is None:
            raise Conflict(
                "this job is not (or no longer) running on this machine", code=ErrorCode.NOT_ASSIGNED
            )
        resource = job.resources.filter(resource_type_id=name, status="held").first()
        if resource is None:
            raise NotFound(f"this job holds no resource {name!r}")
        # The job is entitled to its resource's secret (a token, a DSN); only here, never in the API.
        return Response({"name": name, "metadata": {**resource.metadata, **resource.secret}})


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


def job_agent_urls() -> list:
    return [
        path("jobs/<uuid:job_id>/started", StartedView.as_view(), name="agent-job-started"),
        path("jobs/<uuid:job_id>/logs", LogsView.as_view(), name="agent-job-logs"),
        path("jobs/<uuid:job_id>/finished", FinishedView.as_view(), name="agent-job-finished"),
        path("jobs/<uuid:job_id>/meta/<slug:name>", MetaView.as_view(), name="agent-job-meta"),
        path("interruption", InterruptionView.as_view(), name="agent-interruption"),
        *artifact_agent_urls(),
    ]
