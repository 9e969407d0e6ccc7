from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from apps.core.actors import Actor
from apps.core.admin import ReadOnlyAdmin, run_service_action, short_id_link
from apps.core.errors import DomainError
from apps.core.errors import NotFound as DomainNotFound
from apps.core.ids import ArtifactId, JobId
from apps.core.templatetags.console import between, fine_money, human_seconds
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.jobs.artifacts import artifact_download
from apps.jobs.choices import JOB_LIVE, ArtifactStatus, JobStatus
from apps.jobs.models import Artifact, Job, JobConfiguration, JobLogChunk
from apps.jobs.services import job_config_delete, job_config_save
from apps.jobs.submission import job_cancel
from apps.jobs.timing import job_timing
from apps.machines.costs import job_cost

LOG_TAIL_CHUNKS = 200
LOG_REFRESH_SECONDS = 3


class JobConfigurationForm(forms.ModelForm):
    class Meta:
        model = JobConfiguration
        fields = (
            "org",
            "name",
            "machine_type",
            "command",
            "env",
            "timeout_seconds",
            "priority",
            "max_attempts",
            "reuse",
            "resource_types",
            "artifact_retention_days",
            "checkpoint_interval_seconds",
        )

    def clean(self) -> dict:
        """The service's rules (grant, privileges, env names, unique name), checked before
        anything is written; the admin's save then calls the same service."""
        data = super().clean() or {}
        if self.errors:
            return data
        adding = self.instance._state.adding
        org = data.get("org") if adding else self.instance.org  # the org is read-only on change
        if org is None:
            return data
        try:
            with _dry_run():
                job_config_save(
                    org=org,
                    config=None if adding else self.instance,
                    resource_types=data.get("resource_types") or [],
                    **{k: v for k, v in data.items() if k not in ("org", "resource_types")},
                )
        except DomainError as exc:
            raise ValidationError(exc.detail) from None
        return data


@contextmanager
def _dry_run() -> Iterator[None]:
    """Run a service in a transaction that is always rolled back: its checks, none of its writes."""
    with transaction.atomic():
        yield
        transaction.set_rollback(True)


@admin.register(JobConfiguration)
class JobConfigurationAdmin(admin.ModelAdmin):
    """Saved and deleted through ``job_config_save`` / ``job_config_delete`` (events, rules)."""

    form = JobConfigurationForm
    list_display = ("name", "org", "machine_type", "priority", "timeout_seconds", "max_attempts", "reuse")
    list_filter = ("org", "machine_type", "reuse")
    search_fields = ("name", "command", "org__slug")
    filter_horizontal = ("resource_types",)

    def get_readonly_fields(self, request: HttpRequest, obj: JobConfiguration | None = None) -> tuple:
        return ("org",) if obj is not None else ()

    def get_actions(self, request: HttpRequest) -> dict:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def save_model(
        self, request: HttpRequest, obj: JobConfiguration, form: forms.ModelForm, change: bool
    ) -> None:
        data = form.cleaned_data
        saved = job_config_save(
            org=obj.org,
            config=obj if change else None,
            actor=Actor.admin(request.user.get_username()),
            resource_types=data.get("resource_types") or [],
            **{k: v for k, v in data.items() if k not in ("org", "resource_types")},
        )
        obj.pk = saved.pk
        obj._state.adding = False

    def save_related(self, request: HttpRequest, form: forms.ModelForm, formsets: Any, change: bool) -> None:
        pass  # resource types were set by job_config_save

    def delete_model(self, request: HttpRequest, obj: JobConfiguration) -> None:
        job_config_delete(config=obj, actor=Actor.admin(request.user.get_username()))

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> HttpResponse:
        obj = self.get_object(request, object_id)
        if obj is not None and request.method == "POST" and obj.jobs.exists():
            self.message_user(
                request, f"job configuration {obj.name} has jobs; it cannot be deleted", messages.ERROR
            )
            return HttpResponseRedirect(reverse("admin:jobs_jobconfiguration_change", args=[obj.pk]))
        return super().delete_view(request, object_id, extra_context)


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    """A job is a record: nothing to save or delete. The page answers what happened (timing,
    attempts, log tail, artifacts, cost) and offers the one thing to do: cancel."""

    change_form_template = "admin/jobs/job/change_form.html"
    list_display = (
        "short_id",
        "status_exit",
        "org_config",
        "attempt",
        "waiting_on",
        "instance_short",
        "submitted",
        "wait",
        "run",
    )
    list_filter = ("status", "org", "machine_type", "config")
    search_fields = ("id", "config__name", "org__slug", "pending_reason")
    date_hierarchy = "created_at"
    list_select_related = ("org", "config", "instance")
    fieldsets = (
        (
            None,
            {"fields": ("id", "status_line", "org", "config", "machine_type", "priority", "submitted_by")},
        ),
        ("Timing", {"fields": ("timing",)}),
        ("Attempts", {"fields": ("attempts",)}),
        ("Machine and cost", {"fields": ("machine", "cost")}),
        ("Log tail", {"fields": ("log_tail",)}),
        ("Artifacts", {"fields": ("artifact_links",)}),
        ("Command and environment", {"fields": ("command_block", "env_block")}),
        ("Events", {"fields": ("event_log",), "classes": ("collapse",)}),
    )
    readonly_fields = (
        "id",
        "status_line",
        "org",
        "config",
        "machine_type",
        "priority",
        "submitted_by",
        "timing",
        "attempts",
        "machine",
        "cost",
        "log_tail",
        "artifact_links",
        "command_block",
        "env_block",
        "event_log",
    )
    actions = ["cancel"]

    def get_urls(self) -> list:
        view = self.admin_site.admin_view
        return [
            path("<uuid:pk>/cancel/", view(self.cancel_view), name="jobs_job_cancel"),
            path("<uuid:pk>/log/", view(self.log_view), name="jobs_job_log"),
            path("<uuid:pk>/tail/", view(self.tail_view), name="jobs_job_tail"),
            path(
                "<uuid:pk>/artifacts/<uuid:artifact_id>/", view(self.artifact_view), name="jobs_job_artifact"
            ),
            *super().get_urls(),
        ]

    def get_actions(self, request: HttpRequest) -> dict:
        # the cancel action is a write through the service: offered to operators who may view jobs
        actions = admin.ModelAdmin.get_actions(self, request)
        actions.pop("delete_selected", None)
        return actions

    # ---- list columns ----------------------------------------------------------------------

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Job) -> str:
        return short_id_link(obj.pk)

    @admin.display(description="status", ordering="status")
    def status_exit(self, obj: Job) -> str:
        return obj.status if obj.exit_code is None else f"{obj.status} (exit {obj.exit_code})"

    @admin.display(description="org / config", ordering="config__name")
    def org_config(self, obj: Job) -> str:
        return f"{obj.org.slug}/{obj.config.name}"

    @admin.display(description="machine")
    def instance_short(self, obj: Job) -> str:
        if obj.instance_id is None:
            return "-"
        return short_id_link(
            obj.instance_id, reverse("admin:machines_machineinstance_change", args=[obj.instance_id])
        )

    @admin.display(description="waiting on", ordering="pending_reason")
    def waiting_on(self, obj: Job) -> str:
        if obj.status not in JOB_LIVE or not obj.pending_reason:
            return "-"
        return format_html('<span title="{}">{}</span>', obj.pending_reason, obj.pending_reason)

    @admin.display(description="submitted", ordering="created_at")
    def submitted(self, obj: Job) -> str:
        """To the second; today's jobs show the time only (the date is in the tooltip)."""
        at = timezone.localtime(obj.created_at)
        full = at.strftime("%Y-%m-%d %H:%M:%S")
        short = at.strftime("%H:%M:%S") if at.date() == timezone.localdate() else full
        return format_html('<span title="{}">{}</span>', full, short)

    @admin.display(description="wait")
    def wait(self, obj: Job) -> str:
        end = obj.started_at or (None if obj.status in JOB_LIVE else obj.finished_at)
        return human_seconds(between(obj.queued_at, end))

    @admin.display(description="run")
    def run(self, obj: Job) -> str:
        return human_seconds(between(obj.started_at, obj.finished_at))

    # ---- the job page ----------------------------------------------------------------------

    @admin.display(description="status")
    def status_line(self, obj: Job) -> str:
        extra = " (cancel requested)" if obj.cancel_requested and obj.status in JOB_LIVE else ""
        reason = obj.pending_reason if obj.status in JOB_LIVE else obj.failure_reason
        return format_html(
            "<b>{}</b>{}{}{}",
            obj.status,
            extra,
            f" — {reason}" if reason else "",
            f" — exit code {obj.exit_code}" if obj.exit_code is not None else "",
        )

    @admin.display(description="when")
    def timing(self, obj: Job) -> str:
        def at(t: Any) -> str:
            return timezone.localtime(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"

        queued_for = between(
            obj.queued_at, obj.admitted_at or (None if obj.status in JOB_LIVE else obj.finished_at)
        )
        rows = [
            ("submitted", at(obj.created_at), ""),
            ("queued", at(obj.queued_at), f"in the queue {human_seconds(queued_for)}"),
            ("admitted", at(obj.admitted_at), ""),
            ("assigned", at(obj.assigned_at), ""),
            ("started", at(obj.started_at), f"waited {self.wait(obj)} (queued → started)"),
            ("finished", at(obj.finished_at), f"ran {self.run(obj)}" if obj.started_at else ""),
        ]
        # Where the start went (apps/jobs/timing.py: `catacloud jobs show --timing`).
        timing = job_timing(obj)
        stages = [
            (s["name"], "-" if s["ms"] is None else f"{s['ms']:.1f} ms", s["what"]) for s in timing["stages"]
        ]
        if timing["launch"]:  # after running: what its command waited for on its machine
            launch = timing["launch"]
            stages.append((f"then {launch['name']}", f"{launch['ms']:.1f} ms", launch["what"]))
        if timing["trace_id"]:
            stages.append(("trace", timing["trace_id"], "this job's trace in the tracing backend"))
        return format_html(
            '<table class="cc-kv">{}</table><p>Where the start went:</p>'
            '<table class="cc-kv" id="cc-start-timing">{}</table>',
            format_html_join("", "<tr><th>{}</th><td>{}</td><td>{}</td></tr>", rows),
            format_html_join("", "<tr><th>{}</th><td>{}</td><td>{}</td></tr>", stages),
        )

    @admin.display(description="attempts")
    def attempts(self, obj: Job) -> str:
        requeues = Event.objects.filter(job_id=obj.pk, kind=EventKind.JOB_REQUEUED).order_by("id")
        rows = [
            (
                timezone.localtime(e.created_at).strftime("%Y-%m-%d %H:%M:%S"),
                f"attempt {e.data.get('attempt', '?')} after",
                e.reason,
                "" if e.data.get("counts", True) else "(free: the operator's doing)",
            )
            for e in requeues
        ]
        head = format_html(
            "attempt <b>{}</b> of at most {} counted ({} free requeues){}",
            obj.attempt,
            obj.max_attempts,
            obj.free_requeues,
            format_html("; last requeue: {}", obj.requeue_reason) if obj.requeue_reason else "",
        )
        if not rows:
            return head
        return format_html(
            '{}<table class="cc-kv">{}</table>',
            head,
            format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", rows),
        )

    @admin.display(description="machine")
    def machine(self, obj: Job) -> str:
        if obj.instance_id is None:
            return "-"
        inst = obj.instance
        if inst is None:
            return "-"
        return format_html(
            '<a href="{}">{}</a> {} · {}',
            reverse("admin:machines_machineinstance_change", args=[inst.pk]),
            short_id_link(inst.pk),
            inst.status,
            inst.provider_id or "no provider id yet",
        )

    @admin.display(description="cost")
    def cost(self, obj: Job) -> str:
        cost = job_cost(obj, now=timezone.now())
        machines = ", ".join(f"{m['instance'][:8]} {fine_money(m['amount'])}" for m in cost["machines"])
        return format_html(
            "{} {}{}",
            fine_money(cost["amount"]),
            cost["currency"],
            f" (its share of: {machines})" if machines else " (no machine held yet)",
        )

    @admin.display(description="last lines")
    def log_tail(self, obj: Job) -> str:
        return self._log_tail_html(obj)

    def _log_tail_html(self, obj: Job) -> str:
        """The current attempt's last lines; while the job lives, htmx fetches them again
        every few seconds (``tail_view``)."""
        chunks = list(
            JobLogChunk.objects.filter(job=obj, attempt=obj.attempt)
            .order_by("-seq")
            .values_list("stream", "data")[:LOG_TAIL_CHUNKS]
        )
        chunks.reverse()
        poll = (
            format_html(
                ' hx-get="{}" hx-trigger="every {}s" hx-swap="outerHTML"',
                reverse("admin:jobs_job_tail", args=[obj.pk]),
                LOG_REFRESH_SECONDS,
            )
            if obj.status in JOB_LIVE
            else ""
        )
        if not chunks:
            return format_html(
                '<div id="cc-tail"{}><i>no output yet (attempt {})</i></div>', poll, obj.attempt
            )
        body = format_html_join("", '<span class="{}">{}</span>', chunks)
        return format_html(
            '<div id="cc-tail"{}><pre class="cc-log" id="cc-log">{}</pre>'
            '<a href="{}?attempt={}">whole log of attempt {}</a></div>',
            poll,
            body,
            reverse("admin:jobs_job_log", args=[obj.pk]),
            obj.attempt,
            obj.attempt,
        )

    @admin.display(description="files")
    def artifact_links(self, obj: Job) -> str:
        rows = (
            Artifact.objects.filter(job=obj).exclude(status=ArtifactStatus.EXPIRED).order_by("kind", "name")
        )
        items = []
        for a in rows:
            if a.status == ArtifactStatus.STORED and a.kind == Artifact.KIND_OUTPUT:
                link = format_html(
                    '<a href="{}">{}</a>', reverse("admin:jobs_job_artifact", args=[obj.pk, a.pk]), a.name
                )
            else:
                link = format_html("{}", a.name)
            items.append((link, a.kind, f"{a.size:,} bytes", a.status, a.error))
        if not items:
            return "none"
        return format_html(
            '<table class="cc-kv">{}</table>',
            format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", items),
        )

    @admin.display(description="command")
    def command_block(self, obj: Job) -> str:
        return format_html('<pre class="cc-log">{}</pre>', obj.command)

    @admin.display(description="environment")
    def env_block(self, obj: Job) -> str:
        rows = [(k, v) for k, v in sorted(obj.env.items())]
        rows += [(k, "•••••• (secret)") for k in sorted(obj.secret_env)]
        if not rows:
            return "-"
        return format_html(
            '<table class="cc-kv">{}</table>', format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", rows)
        )

    @admin.display(description="events")
    def event_log(self, obj: Job) -> str:
        rows = Event.objects.filter(job_id=obj.pk).order_by("id")[:200]
        return (
            format_html_join(
                "\n",
                "<div>{} &nbsp; <b>{}</b> &nbsp; {} {}</div>",
                ((e.created_at.strftime("%Y-%m-%d %H:%M:%S"), e.kind, e.actor, e.reason) for e in rows),
            )
            or "-"
        )

    def render_change_form(self, request: HttpRequest, context: dict, *args: Any, **kwargs: Any) -> Any:
        obj = context.get("original")
        context["can_cancel"] = obj is not None and obj.status in JOB_LIVE
        return super().render_change_form(request, context, *args, **kwargs)

    # ---- writes and downloads --------------------------------------------------------------

    def cancel_view(self, request: HttpRequest, pk: JobId) -> HttpResponse:
        job = get_object_or_404(Job, pk=pk)
        change = reverse("admin:jobs_job_change", args=[job.pk])
        if request.method != "POST":
            return HttpResponseRedirect(change)
        try:
            job = job_cancel(job=job, actor=Actor.admin(request.user.get_username()))
        except DomainError as exc:
            self.message_user(request, f"not cancelled: {exc.detail}", messages.WARNING)
        else:
            done = (
                "cancelled" if job.status == JobStatus.CANCELLED else "cancel requested: the agent stops it"
            )
            self.message_user(request, f"job {str(job.pk)[:8]}: {done}", messages.SUCCESS)
        return HttpResponseRedirect(change)

    def tail_view(self, request: HttpRequest, pk: JobId) -> HttpResponse:
        return HttpResponse(self._log_tail_html(get_object_or_404(Job, pk=pk)))

    def log_view(self, request: HttpRequest, pk: JobId) -> HttpResponse:
        job = get_object_or_404(Job, pk=pk)
        try:
            attempt = int(request.GET.get("attempt", job.attempt))
        except ValueError:
            attempt = job.attempt
        text = "".join(
            JobLogChunk.objects.filter(job=job, attempt=attempt)
            .order_by("seq")
            .values_list("data", flat=True)
        )
        return HttpResponse(text, content_type="text/plain; charset=utf-8")

    def artifact_view(self, request: HttpRequest, pk: JobId, artifact_id: ArtifactId) -> HttpResponseBase:
        artifact = get_object_or_404(
            Artifact, job_id=pk, pk=artifact_id, kind=Artifact.KIND_OUTPUT, status=ArtifactStatus.STORED
        )
        try:
            return artifact_download(artifact)
        except DomainNotFound as exc:
            raise Http404(exc.detail) from None

    @admin.action(description="Cancel selected jobs")
    def cancel(self, request: HttpRequest, queryset) -> None:
        actor = Actor.admin(request.user.get_username())
        run_service_action(
            self, request, queryset, "cancelled or cancel requested", lambda j: job_cancel(job=j, actor=actor)
        )
