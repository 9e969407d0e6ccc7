"""The console's GitHub Actions pages: the connection (secrets write-only, never shown), runner
classes (saved through the services, like the API and the catalog), and read-only lists of
the workflow jobs seen, the runners started and the deliveries received."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin

from apps.ci import forms as ci_forms
from apps.ci.forms import ServiceSavedAdmin, ThroughService, id_pairs
from apps.core.admin import ReadOnlyAdmin, neutral_bool
from apps.github.models import GitHubConnection, Runner, RunnerClass, WebhookDelivery, WorkflowJob
from apps.github.services import CLASS_FIELDS, connection_set, runner_class_save


class ConnectionForm(ThroughService):
    new_private_key = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "autocomplete": "off"}),
        help_text="the App's .pem; write-only: leave empty to keep the stored key",
    )
    new_webhook_secret = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="write-only: leave empty to keep the stored secret",
    )
    installation_ids = forms.CharField(
        required=False, help_text="installation ids, comma-separated; id:account to name the account"
    )

    class Meta:
        model = GitHubConnection
        fields = ("org", "app_id", "api_url")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["installation_ids"].initial = ", ".join(
                f"{i.installation_id}:{i.account}" if i.account else str(i.installation_id)
                for i in self.instance.installations.order_by("installation_id")
            )

    def clean_installation_ids(self) -> list[dict[str, Any]]:
        pairs = id_pairs(
            self.cleaned_data.get("installation_ids") or "",
            what="an installation id is a number",
            second_required=False,
        )
        return [{"id": ident, "account": account} for ident, account in pairs]

    def save_through_service(self) -> Any:
        conn, _ = connection_set(
            org=self.cleaned_data["org"],
            app_id=self.cleaned_data["app_id"],
            api_url=self.cleaned_data["api_url"],
            private_key=self.cleaned_data.get("new_private_key") or None,
            webhook_secret=self.cleaned_data.get("new_webhook_secret") or None,
            installations=self.cleaned_data.get("installation_ids"),
            actor=self.actor,
        )
        return conn


@admin.register(GitHubConnection)
class GitHubConnectionAdmin(ServiceSavedAdmin):
    form = ConnectionForm
    list_display = ("org", "app_id", "api_url", "secrets_set", "installation_list", "updated_at")

    @admin.display(description="key and secret set")
    def secrets_set(self, obj: GitHubConnection) -> str:
        return neutral_bool(bool(obj.private_key and obj.webhook_secret))

    @admin.display(description="installations")
    def installation_list(self, obj: GitHubConnection) -> str:
        return ", ".join(str(i) for i in obj.installations.all())


class RunnerClassForm(ci_forms.RunnerClassForm):
    labels_text = forms.CharField(
        label="labels", help_text="runs-on labels, comma-separated, e.g. self-hosted, catacloud-linux-2cpu"
    )
    labels_field = "labels"
    class_fields = CLASS_FIELDS
    class_save = runner_class_save

    class Meta:
        model = RunnerClass
        fields = tuple(f for f in CLASS_FIELDS if f != "labels") + ("org",)


@admin.register(RunnerClass)
class RunnerClassAdmin(ServiceSavedAdmin):
    form = RunnerClassForm
    list_display = ("name", "org", "labels", "machine_type", "pool", "scope", "priority", "job_config")
    list_filter = ("org", "machine_type")
    readonly_fields = ("job_config",)


@admin.register(WorkflowJob)
class WorkflowJobAdmin(ReadOnlyAdmin):
    list_display = (
        "github_id",
        "run_attempt",
        "repository",
        "workflow",
        "name",
        "status",
        "conclusion",
        "runner_class",
        "runner_name",
        "job",
        "seen_at",
    )
    list_filter = ("status", "org", "runner_class")
    search_fields = ("repository", "workflow", "name", "runner_name")


@admin.register(Runner)
class RunnerAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "job",
        "runner_class",
        "github_runner_id",
        "registered_at",
        "online_at",
        "workflow_job",
        "retire_requested_at",
    )
    list_filter = ("runner_class",)
    search_fields = ("name",)


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):
    list_display = ("guid", "event", "action", "org", "received_at", "processed_at", "outcome")
    list_filter = ("event", "org")
    search_fields = ("guid",)
