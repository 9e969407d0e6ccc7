"""The console's GitLab CI pages: the connection (its token and secret token write-only, never
shown), runner classes (saved through the services, like the API and the catalog), and
read-only lists of the CI jobs seen, the runners started and the Job events received."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin

from apps.ci import forms as ci_forms
from apps.ci.forms import ServiceSavedAdmin, ThroughService, id_pairs
from apps.core.actors import Actor
from apps.core.admin import ReadOnlyAdmin, neutral_bool
from apps.gitlab.models import GitLabConnection, GitLabDelivery, GitLabJob, GitLabRunner, GitLabRunnerClass
from apps.gitlab.runners import class_runners_rotate
from apps.gitlab.services import CLASS_FIELDS, connection_set, runner_class_save


class ConnectionForm(ThroughService):
    new_token = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="an access token allowed to create runners; write-only: leave empty to keep the stored one",
    )
    new_webhook_token = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="the webhook's secret token; write-only: leave empty to keep the stored one",
    )
    project_list = forms.CharField(
        required=False, label="projects", help_text="id:path, comma-separated, e.g. 12:acme/app, 13:acme/web"
    )

    class Meta:
        model = GitLabConnection
        fields = ("org", "url")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["project_list"].initial = ", ".join(
                f"{p.project_id}:{p.path}" for p in self.instance.projects.order_by("path")
            )

    def clean_project_list(self) -> list[dict[str, Any]]:
        pairs = id_pairs(
            self.cleaned_data.get("project_list") or "", what="a project is id:path", second_required=True
        )
        return [{"id": ident, "path": path} for ident, path in pairs]

    def save_through_service(self) -> Any:
        conn, _ = connection_set(
            org=self.cleaned_data["org"],
            url=self.cleaned_data["url"],
            token=self.cleaned_data.get("new_token") or None,
            webhook_token=self.cleaned_data.get("new_webhook_token") or None,
            projects=self.cleaned_data.get("project_list"),
            actor=self.actor,
        )
        return conn


@admin.register(GitLabConnection)
class GitLabConnectionAdmin(ServiceSavedAdmin):
    form = ConnectionForm
    list_display = ("org", "url", "secrets_set", "project_paths", "updated_at")

    @admin.display(description="token and secret token set")
    def secrets_set(self, obj: GitLabConnection) -> str:
        return neutral_bool(bool(obj.token and obj.webhook_token))

    @admin.display(description="projects")
    def project_paths(self, obj: GitLabConnection) -> str:
        return ", ".join(p.path for p in obj.projects.all())


class RunnerClassForm(ci_forms.RunnerClassForm):
    tags_text = forms.CharField(
        label="tags", help_text="the jobs' tags, comma-separated, e.g. catacloud, linux-2cpu"
    )
    labels_field = "tags"
    class_fields = CLASS_FIELDS
    class_save = runner_class_save

    class Meta:
        model = GitLabRunnerClass
        fields = tuple(f for f in CLASS_FIELDS if f != "tags") + ("org",)


@admin.register(GitLabRunnerClass)
class GitLabRunnerClassAdmin(ServiceSavedAdmin):
    form = RunnerClassForm
    list_display = (
        "name",
        "org",
        "tags",
        "machine_type",
        "pool",
        "scope",
        "executor",
        "runner_mode",
        "priority",
        "job_config",
        "blocked_reason",
    )
    list_filter = ("org", "machine_type", "runner_mode")
    readonly_fields = ("job_config", "blocked_at", "blocked_reason")
    actions = ("rotate_class_runner_tokens",)

    @admin.action(description="Rotate class runner tokens now")
    def rotate_class_runner_tokens(self, request: Any, queryset: Any) -> None:
        """Class runner mode: a new token for each class runner of the selected classes (their
        machines handed the old one and not running a CI job are retired)."""
        actor = Actor.admin(request.user.get_username())
        rotated = sum(class_runners_rotate(runner_class=rc, actor=actor) for rc in queryset)
        self.message_user(request, f"{rotated} class runner token(s) rotated")


@admin.register(GitLabJob)
class GitLabJobAdmin(ReadOnlyAdmin):
    list_display = (
        "gitlab_id",
        "project",
        "pipeline",
        "name",
        "status",
        "failure_reason",
        "runner_class",
        "runner_name",
        "job",
        "seen_at",
    )
    list_filter = ("status", "org", "runner_class")
    search_fields = ("project", "pipeline", "name", "runner_name")


@admin.register(GitLabRunner)
class GitLabRunnerAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "job",
        "runner_class",
        "gitlab_runner_id",
        "registered_at",
        "online_at",
        "gitlab_job",
        "retire_requested_at",
    )
    list_filter = ("runner_class",)
    search_fields = ("name",)


@admin.register(GitLabDelivery)
class GitLabDeliveryAdmin(ReadOnlyAdmin):
    list_display = ("key", "event", "action", "org", "received_at", "processed_at", "outcome")
    list_filter = ("event", "org")
    search_fields = ("key",)
