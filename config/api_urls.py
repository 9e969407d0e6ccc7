"""The v1 API: every app's viewsets, mounted under /api/v1/."""

from __future__ import annotations

from django.urls import path, re_path
from rest_framework.routers import DefaultRouter

from apps.billing.api.views import BudgetViewSet, CostViewSet
from apps.control.api.views import EventViewSet
from apps.github.api.views import GitHubConnectionView, RunnerClassViewSet, WorkflowJobViewSet
from apps.gitlab.api.views import GitLabConnectionView, GitLabJobViewSet
from apps.gitlab.api.views import RunnerClassViewSet as GitLabRunnerClassViewSet
from apps.jobs.api.views import JobConfigurationViewSet, JobViewSet
from apps.machines.api.views import (
    EnrolmentTokenViewSet,
    HostViewSet,
    InstanceViewSet,
    MachineTypeViewSet,
    ProviderAccountViewSet,
)
from apps.orgs.api.registries import RegistryCredentialViewSet
from apps.pools.api.views import PoolViewSet
from apps.resources.api.views import ResourceTypeViewSet, ResourceViewSet

router = DefaultRouter(trailing_slash=True)
router.register("machine-types", MachineTypeViewSet, basename="machine-type")
router.register("provider-accounts", ProviderAccountViewSet, basename="provider-account")
router.register("instances", InstanceViewSet, basename="instance")
router.register("hosts", HostViewSet, basename="host")
router.register("enrolment-tokens", EnrolmentTokenViewSet, basename="enrolment-token")
router.register("costs", CostViewSet, basename="cost")
router.register("budgets", BudgetViewSet, basename="budget")
router.register("job-configs", JobConfigurationViewSet, basename="job-config")
router.register("jobs", JobViewSet, basename="job")
router.register("events", EventViewSet, basename="event")
router.register("pools", PoolViewSet, basename="pool")
router.register("resource-types", ResourceTypeViewSet, basename="resource-type")
router.register("resources", ResourceViewSet, basename="resource")
router.register("registry-credentials", RegistryCredentialViewSet, basename="registry-credential")
router.register("github/runner-classes", RunnerClassViewSet, basename="github-runner-class")
router.register("github/workflow-jobs", WorkflowJobViewSet, basename="github-workflow-job")
router.register("gitlab/runner-classes", GitLabRunnerClassViewSet, basename="gitlab-runner-class")
router.register("gitlab/jobs", GitLabJobViewSet, basename="gitlab-job")

urlpatterns = [
    # GET /jobs/{id}/artifacts/{name}: names may contain "/" and carry no trailing slash.
    re_path(
        r"^jobs/(?P<pk>[^/.]+)/artifacts/(?P<name>[^/](?:.*[^/])?)$",
        JobViewSet.as_view({"get": "artifact"}),
        name="job-artifact",
    ),
    path("github/connection/", GitHubConnectionView.as_view(), name="github-connection"),
    path("gitlab/connection/", GitLabConnectionView.as_view(), name="gitlab-connection"),
    *router.urls,
]
