from __future__ import annotations

import uuid
from typing import Any

import django_filters
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from apps.core.errors import ErrorCode, ValidationFailed
from apps.jobs.api.serializers import (
    ArtifactSerializer,
    JobConfigurationSerializer,
    JobLogsQuerySerializer,
    JobLogsSerializer,
    JobSerializer,
    JobSubmitSerializer,
)
from apps.jobs.artifacts import artifact_download
from apps.jobs.choices import ArtifactStatus, JobStatus
from apps.jobs.models import Artifact, Job, JobConfiguration, JobLogChunk
from apps.jobs.selectors import configs_to_submit
from apps.jobs.services import job_config_delete, job_config_save
from apps.jobs.submission import IDEMPOTENCY_KEY_MAX, job_cancel, job_submit_once
from apps.jobs.timing import job_timing
from apps.machines.costs import job_cost
from apps.orgs.api.base import IdPrefixFilter, OrgScopedFilterSet, OrgScopedModelViewSet, OrgScopedViewSet


class JobConfigurationFilter(OrgScopedFilterSet):
    id_prefix = IdPrefixFilter()
    machine_type = django_filters.CharFilter(field_name="machine_type__name")

    class Meta:
        model = JobConfiguration
        fields = ("name", "machine_type", "reuse")


class JobConfigurationViewSet(OrgScopedModelViewSet):
    """Named recipes for jobs. Viewers read; admins create, change and delete."""

    queryset = JobConfiguration.objects.select_related("machine_type").prefetch_related("resource_types")
    serializer_class = JobConfigurationSerializer
    filterset_class = JobConfigurationFilter
    ordering_fields = ("name", "priority", "created_at")
    ordering = ("name",)

    def perform_create(self, serializer: BaseSerializer) -> None:
        data = dict(serializer.validated_data)
        resource_types = data.pop("resource_types", [])
        serializer.instance = job_config_save(
            org=self.ctx.org, actor=self.actor(), resource_types=resource_types, **data
        )

    def perform_update(self, serializer: BaseSerializer) -> None:
        data = dict(serializer.validated_data)
        resource_types = data.pop("resource_types", None)
        serializer.instance = job_config_save(
            org=self.ctx.org,
            config=serializer.instance,
            actor=self.actor(),
            resource_types=resource_types,
            **data,
        )

    def perform_destroy(self, instance: JobConfiguration) -> None:
        job_config_delete(config=instance, actor=self.actor())


class JobFilter(OrgScopedFilterSet):
    status = django_filters.MultipleChoiceFilter(choices=JobStatus.choices)
    config = django_filters.UUIDFilter(field_name="config_id")
    config_name = django_filters.CharFilter(field_name="config__name")
    id_prefix = IdPrefixFilter()
    machine_type = django_filters.CharFilter(field_name="machine_type__name")

    class Meta:
        model = Job
        fields = ("status", "config", "config_name", "machine_type", "instance")


def _config_by_id_or_name(*, org: Any, ref: str) -> JobConfiguration:
    """The caller's org's configuration with this id or, failing that, this name (names are
    unique in an org; a name that looks like an id is still found by name)."""
    configs = configs_to_submit(org.pk)
    try:
        config = configs.filter(pk=uuid.UUID(ref)).first()
    except ValueError:
        config = None
    if config is None:
        config = configs.filter(name=ref).first()
    if config is None:
        raise ValidationFailed(
            f"config: no job configuration with id or name {ref!r}",
            fields={"config": ["does not exist"]},
            code=ErrorCode.UNKNOWN_CONFIG,
        )
    return config


class JobViewSet(OrgScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Runs of job configurations. Members submit and cancel; viewers read."""

    queryset = Job.objects.select_related("config", "machine_type")
    serializer_class = JobSerializer
    filterset_class = JobFilter
    ordering_fields = ("created_at", "priority", "status", "finished_at")
    ordering = ("-created_at",)
    required_roles = {"create": "member", "cancel": "member"}
    job_scoped_access = True

    def get_queryset(self):
        qs = super().get_queryset()
        if not getattr(self, "swagger_fake_view", False) and self.ctx.job_scope is not None:
            qs = qs.filter(pk=self.ctx.job_scope)  # a job-scoped token reads only its own job
        return qs

    def retrieve(self, request: Request, *args: object, **kwargs: object) -> Response:
        """The job, with ``cost``: its share of every machine it held (the seconds it held
        each; a live machine counts up to now)."""
        job = self.get_object()
        data = dict(self.get_serializer(job).data)
        data["cost"] = job_cost(job, now=timezone.now())
        return Response(data)

    def check_permissions(self, request: Request) -> None:
        super().check_permissions(request)
        if self.ctx.job_scope is not None and self.action not in (
            "retrieve",
            "logs",
            "artifacts",
            "artifact",
        ):
            raise PermissionDenied("this token may only read its own job")

    @extend_schema(
        request=JobSubmitSerializer,
        responses={201: JobSerializer, 200: JobSerializer},
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                str,
                OpenApiParameter.HEADER,
                description="Any string of up to 200 visible characters naming this submit: a "
                "retry with the same key answers 200 with the job the first one queued "
                "(header Idempotent-Replayed: true) instead of queueing a second.",
            )
        ],
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        key = request.headers.get("Idempotency-Key", "")
        if len(key) > IDEMPOTENCY_KEY_MAX or not key.isascii() or not all(c.isprintable() for c in key):
            raise ValidationFailed(
                f"Idempotency-Key: at most {IDEMPOTENCY_KEY_MAX} visible ASCII characters",
                fields={"Idempotency-Key": [f"at most {IDEMPOTENCY_KEY_MAX} visible ASCII characters"]},
            )
        body = JobSubmitSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        config = _config_by_id_or_name(org=self.ctx.org, ref=body.validated_data["config"])
        job, queued = job_submit_once(
            idempotency_key=key.strip(),
            org=self.ctx.org,
            config=config,
            env=body.validated_data.get("env"),
            secret_env=body.validated_data.get("secret_env"),  # written with the job
            image=body.validated_data.get("image"),
            user=request.user,
            actor=self.actor(),
        )
        context = self.get_serializer_context()
        answer = Response(
            JobSerializer(job, context=context).data,
            status=status.HTTP_201_CREATED if queued else status.HTTP_200_OK,
        )
        if not queued:
            answer["Idempotent-Replayed"] = "true"
        return answer

    @extend_schema(responses={200: dict})
    @action(detail=True, methods=["get"])
    def timing(self, request: Request, pk: str | None = None) -> Response:
        """Where the latest attempt's start went: its stages (admission, placement, the
        wake-up and poll, the agent) in milliseconds, and its trace id when tracing is on."""
        return Response(job_timing(self.get_object()))

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        job = job_cancel(job=self.get_object(), actor=self.actor())
        context = self.get_serializer_context()
        return Response(JobSerializer(job, context=context).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        parameters=[
            OpenApiParameter("after", int, description="only chunks with seq greater than this"),
            OpenApiParameter("attempt", int, description="which attempt (default: the current one)"),
        ],
        responses={200: JobLogsSerializer},
    )
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, pk: str | None = None) -> Response:
        """The job's output so far (poll with ?after=next_after to follow it)."""
        job = self.get_object()
        query = JobLogsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        after = query.validated_data["after"]
        attempt = query.validated_data.get("attempt", job.attempt)
        if attempt > job.attempt:  # an attempt that never started has no output, ever
            plural = "" if job.attempt == 1 else "s"
            raise ValidationFailed.field(
                "attempt",
                f"job {job.pk} has had {job.attempt} attempt{plural}; attempt takes 1 to {job.attempt}",
            )
        chunks = list(
            JobLogChunk.objects.filter(job=job, attempt=attempt, seq__gt=after)
            .order_by("seq")
            .values("attempt", "seq", "stream", "data")[:5000]
        )
        return Response(
            {
                "job": job.pk,
                "status": job.status,
                "attempt": attempt,
                "text": "".join(c["data"] for c in chunks),
                "chunks": chunks,
                "next_after": chunks[-1]["seq"] if chunks else after,
            }
        )

    @extend_schema(responses={200: ArtifactSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="artifacts")
    def artifacts(self, request: Request, pk: str | None = None) -> Response:
        """Files the job kept: name, size, sha256 (outputs, and its latest checkpoint)."""
        job = self.get_object()
        rows = (
            Artifact.objects.filter(job=job).exclude(status=ArtifactStatus.EXPIRED).order_by("kind", "name")
        )
        return Response(ArtifactSerializer(rows, many=True).data)

    @extend_schema(responses={(200, "application/octet-stream"): bytes})
    def artifact(self, request: Request, pk: str | None = None, name: str = "") -> Any:
        """One output: streamed, or a redirect to a short-lived presigned URL (S3)."""
        job = self.get_object()
        artifact = Artifact.objects.filter(
            job=job, kind=Artifact.KIND_OUTPUT, name=name, status=ArtifactStatus.STORED
        ).first()
        if artifact is None:
            raise NotFound("no such artifact")
        return artifact_download(artifact)
