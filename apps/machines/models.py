from __future__ import annotations

import uuid
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from apps.core.crypto import encrypted
from apps.core.errors import ErrorCode
from apps.machines.choices import HostStatus, InstanceStatus, Policy, ProviderKind
from catacloud.agent.netns import normalize_network


def validate_network(value: object) -> None:
    """A machine type's ``network`` (catacloud/agent/netns.py reads it on the machine)."""
    try:
        normalize_network(value)
    except ValueError as exc:
        raise ValidationError(str(exc), code=ErrorCode.INVALID) from None


class ProviderAccount(models.Model):
    """Credentials for one cloud project or account. Credentials are encrypted at rest.

    ``org`` None: the operator's (its machine types are granted to organizations). Otherwise an
    organization's own cloud account (apps/machines/owned.py): its machine types are that
    organization's alone and its machines are paid by it. Names are unique per owner."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=64)
    kind = models.CharField(max_length=16, choices=ProviderKind.choices)
    org = models.ForeignKey(
        "orgs.Organization",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="provider_accounts",
        help_text="empty: the operator's; else the organization's own cloud account",
    )
    # Non-secret driver settings: location/region, endpoint, network, boot delay…
    config = models.JSONField(default=dict, blank=True)
    credentials_encrypted = models.TextField(blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["name"], condition=Q(org__isnull=True), name="provider_account_name_unique"
            ),
            models.UniqueConstraint(
                fields=["org", "name"],
                condition=Q(org__isnull=False),
                name="provider_account_org_name_unique",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"

    credentials = encrypted("credentials_encrypted", "the provider's credentials")


class MachineType(models.Model):
    """What to create: the provider, size, image, and what it costs."""

    # What an operator sets on a machine type (the catalog, the admin, the API shows them), besides
    # its name and provider account; the ones a catalog entry must give; and (below) the ones
    # whose change makes existing machines outdated (pool drift).
    SETTABLE_FIELDS = (
        "description",
        "server_type",
        "location",
        "image",
        "cpus",
        "memory_mb",
        "gpus",
        "spot",
        "price_per_hour",
        "billing_increment_seconds",
        "min_billed_seconds",
        "required_privilege",
        "disk_gb",
        "network",
        "image_cache_mb",
        "host_labels",
        "alternatives",
        "arch",
        "labels",
        "containers",
    )
    REQUIRED_FIELDS = ("server_type", "cpus", "memory_mb")
    BUILD_FIELDS = (
        "provider_account_id",
        "server_type",
        "location",
        "image",
        "cpus",
        "memory_mb",
        "gpus",
        "spot",
        "host_labels",
        "containers",
    )

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=64)
    description = models.CharField(max_length=300, blank=True)
    provider_account = models.ForeignKey(
        ProviderAccount, on_delete=models.PROTECT, related_name="machine_types"
    )
    # Its provider account's owner, kept here for the per-owner name constraint: None for the
    # operator's types, else the organization whose own account it buys on (only it sees it).
    org = models.ForeignKey(
        "orgs.Organization",
        null=True,
        blank=True,
        editable=False,
        on_delete=models.PROTECT,
        related_name="own_machine_types",
    )
    server_type = models.CharField(max_length=64, help_text="Hetzner server type or EC2 instance type")
    location = models.CharField(max_length=64, blank=True, help_text="Hetzner location or AWS region/AZ")
    image = models.CharField(max_length=200, blank=True)
    cpus = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    memory_mb = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    gpus = models.PositiveIntegerField(default=0)
    spot = models.BooleanField(default=False)
    price_per_hour = models.DecimalField(max_digits=12, decimal_places=6, default=Decimal("0"))
    billing_increment_seconds = models.PositiveIntegerField(
        default=3600,
        validators=[MinValueValidator(1)],
        help_text="Hetzner: 3600 (every started hour); EC2: 1",
    )
    min_billed_seconds = models.PositiveIntegerField(default=0, help_text="EC2: 60")
    required_privilege = models.ForeignKey(
        "orgs.Privilege", null=True, blank=True, on_delete=models.PROTECT, related_name="machine_types"
    )
    disk_gb = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="GB a job may fill (local machines enforce it); empty: no limit",
    )
    network = models.JSONField(
        default=dict,
        blank=True,
        validators=[validate_network],
        help_text='besides the internet, what jobs may reach: {"allow": ["10.0.0.5:3128"]}',
    )
    image_cache_mb = models.PositiveIntegerField(
        default=10240,
        validators=[MinValueValidator(1)],
        help_text="MB of a machine's image store; least recently used images go first",
    )
    # On enrolled hosts (a provider account of kind ``hosts``): the labels a host must carry for
    # this type's jobs to run there; its cpus, memory_mb and disk_gb are what one job takes of it.
    host_labels = models.JSONField(
        default=dict,
        blank=True,
        help_text='enrolled hosts only: labels a host must carry, e.g. {"gpu": "a4000"}',
    )
    # Candidates (apps.machines.capacity): other machine types (names) that can run this type's
    # jobs: another location, server type, provider account, spot or on-demand. Placement buys
    # the cheapest candidate the organization is granted that is not cooling down.
    alternatives = models.JSONField(
        default=list,
        blank=True,
        help_text='names of machine types that may run its jobs instead, e.g. ["cx33-nbg1"]',
    )
    # What a job configuration's requirements may ask besides its size (apps.machines.capacity).
    arch = models.CharField(max_length=16, default="x86_64", help_text="x86_64 or arm64")
    labels = models.JSONField(
        default=dict,
        blank=True,
        help_text='what requirements may ask of it, e.g. {"gpu": "a4000", "disk": "nvme"}',
    )
    # Its jobs get a container engine of their own (rootless Podman with Docker's API, inside
    # their sandbox: catacloud/agent/containers.py); their sandbox then allows user namespaces.
    containers = models.BooleanField(
        default=False,
        help_text="jobs get their own Docker-compatible engine (rootless Podman); their sandbox "
        "then allows nested user namespaces",
    )
    # A provider's capacity error (Hetzner resource_unavailable, EC2 InsufficientInstanceCapacity)
    # cools the type down until then: nothing of it is bought, its jobs fall over to a candidate.
    capacity_cooling_until = models.DateTimeField(null=True, blank=True, editable=False)
    capacity_error = models.CharField(max_length=300, blank=True, editable=False)
    version = models.PositiveIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["name"], condition=Q(org__isnull=True), name="machine_type_name_unique"
            ),
            models.UniqueConstraint(
                fields=["org", "name"], condition=Q(org__isnull=False), name="machine_type_org_name_unique"
            ),
            models.CheckConstraint(
                condition=Q(price_per_hour__gte=0), name="machine_type_price_non_negative"
            ),
            models.CheckConstraint(
                condition=Q(billing_increment_seconds__gte=1), name="machine_type_increment_pos"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class OrgMachineType(models.Model):
    """A grant of one machine type to one org, with the org's quotas on it."""

    # The fields an operator sets on a grant (API, admin, catalog, grant_upsert).
    QUOTA_FIELDS = (
        "max_concurrent_jobs",
        "max_instances",
        "max_pool_size",
        "cpu_quota",
        "memory_quota_mb",
        "gpu_quota",
        "policy",
        "max_wait_seconds",
    )

    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="machine_type_grants")
    machine_type = models.ForeignKey(MachineType, on_delete=models.CASCADE, related_name="grants")
    max_concurrent_jobs = models.PositiveIntegerField(default=10)
    max_instances = models.PositiveIntegerField(default=10)
    max_pool_size = models.PositiveIntegerField(default=10)
    # Null: no limit beyond max_instances.
    cpu_quota = models.PositiveIntegerField(null=True, blank=True)
    memory_quota_mb = models.PositiveIntegerField(null=True, blank=True)
    gpu_quota = models.PositiveIntegerField(null=True, blank=True)
    policy = models.CharField(max_length=8, choices=Policy.choices, default=Policy.SPEED)
    max_wait_seconds = models.PositiveIntegerField(
        default=90,
        help_text="cost policy: wait this long for a paid machine before buying a new one (~2 boots)",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "machine type grant"
        constraints = [
            models.UniqueConstraint(fields=["org", "machine_type"], name="org_machine_type_unique")
        ]
        ordering = ["org__slug", "machine_type__name"]

    def __str__(self) -> str:
        return f"{self.machine_type} for {self.org}"


class MachineInstance(models.Model):
    """One machine's whole life; the aggregate the life-cycle saga drives."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey("orgs.Organization", on_delete=models.PROTECT, related_name="instances")
    machine_type = models.ForeignKey(MachineType, on_delete=models.PROTECT, related_name="instances")
    machine_type_version = models.PositiveIntegerField(default=1)
    provider_account = models.ForeignKey(ProviderAccount, on_delete=models.PROTECT, related_name="instances")
    pool = models.ForeignKey(
        "pools.InstancePool", null=True, blank=True, on_delete=models.SET_NULL, related_name="members"
    )
    # A slot of an enrolled host (its machine type's share of the host): the host it runs on,
    # chosen when the slot is requested (apps.machines.hosts). None: a machine of its own.
    host = models.ForeignKey(
        "machines.Host", null=True, blank=True, on_delete=models.PROTECT, related_name="slots"
    )
    status = models.CharField(max_length=16, choices=InstanceStatus.choices, default=InstanceStatus.PENDING)
    provider_id = models.CharField(max_length=128, blank=True)
    provider_state = models.CharField(max_length=32, blank=True)
    public_ip = models.CharField(max_length=64, blank=True)
    private_ip = models.CharField(max_length=64, blank=True)
    # When the provider last told us provider_state / addresses (create, ready, reconciler).
    provider_checked_at = models.DateTimeField(null=True, blank=True)
    outdated = models.BooleanField(default=False, help_text="built from an older machine type version")
    bootstrap_token_hash = models.CharField(max_length=64, blank=True, editable=False)
    agent_token_hash = models.CharField(max_length=64, blank=True, editable=False)
    claim_id = models.UUIDField(null=True, blank=True)
    claimed_by = models.CharField(max_length=200, blank=True)
    claimed_for = models.CharField(max_length=200, blank=True)
    last_config = models.ForeignKey(
        "jobs.JobConfiguration", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    failure_reason = models.TextField(blank=True)
    # Why it ends (machine_terminated, pool_drained, machine_lost, claim_released, …): a job
    # still on it is requeued with this reason once the machine is gone.
    end_cause = models.CharField(max_length=32, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    provisioning_started_at = models.DateTimeField(null=True, blank=True)
    warming_started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    warmed_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    terminating_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    # When the current status was entered: the reaper's deadlines count from here.
    status_changed_at = models.DateTimeField(default=timezone.now)
    # An acquire with lease_seconds: the reaper releases the claim after this.
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    billed_seconds = models.PositiveIntegerField(null=True, blank=True)
    cost = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    # What the agent said at enrollment: how jobs are isolated (sandbox, uids) and which resource
    # limits hold on the machine (enforced or not, and why).
    isolation = models.JSONField(default=dict, blank=True)
    # The image references its store holds (tags and digests, as its agent last reported them):
    # placement prefers a machine that holds a job's image.
    images = models.JSONField(default=list, blank=True)
    # A pool member: the version of its pool's image list it was told to pull when it enrolled
    # (an older one than its pool's is outdated, as a machine of an older machine type version).
    pool_images_version = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # Claim: WHERE pool_id = %s AND status = 'ready' ORDER BY ready_at LIMIT 1 FOR UPDATE SKIP LOCKED
            models.Index(
                fields=["pool", "ready_at"],
                name="instance_ready_by_pool",
                condition=Q(status=InstanceStatus.READY),
            ),
            # Reaper and reconciler: live rows by provider account / status.
            models.Index(fields=["provider_account", "status"], name="instance_account_status"),
            models.Index(fields=["org", "machine_type", "status"], name="instance_org_type_status"),
            # Reaper deadlines: WHERE status IN (…) AND status_changed_at < now() - deadline
            models.Index(fields=["status", "status_changed_at"], name="instance_status_since"),
            # Agent API authentication: WHERE agent_token_hash = %s
            models.Index(
                fields=["agent_token_hash"], name="instance_agent_token", condition=~Q(agent_token_hash="")
            ),
        ]

    def __str__(self) -> str:
        return f"{self.machine_type} {self.id} ({self.status})"

    @property
    def name(self) -> str:
        return f"cc-{self.id}"

    def event_refs(self) -> dict:
        return {"org": self.org_id, "pool": self.pool_id, "instance": self.pk}


class EnrolmentToken(models.Model):
    """What a host enrolls with: scoped to one organization (only its jobs run there) or shared
    (``org`` None: any granted organization's), with the labels its hosts get; single-use or
    bounded in uses and time; shown once, stored hashed."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    provider_account = models.ForeignKey(
        ProviderAccount, on_delete=models.PROTECT, related_name="enrolment_tokens"
    )
    org = models.ForeignKey(
        "orgs.Organization", null=True, blank=True, on_delete=models.CASCADE, related_name="enrolment_tokens"
    )
    description = models.CharField(max_length=200, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=16, editable=False)  # shown to tell tokens apart
    max_uses = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    uses = models.PositiveIntegerField(default=0, editable=False)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(uses__lte=models.F("max_uses")), name="enrolment_uses")
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.uses}/{self.max_uses} used)"


class Host(models.Model):
    """A machine the user owns (bare metal, a long-lived VM), enrolled with a token: never bought,
    never deleted by the reconciler. Its jobs run in slots (machine instances whose ``host`` it
    is), as many at once as its capacity allows; its agent starts and stops them."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, help_text="the host's name, as its agent reported it")
    provider_account = models.ForeignKey(ProviderAccount, on_delete=models.PROTECT, related_name="hosts")
    # None: shared by the operator (any granted organization's jobs, each in its own sandbox).
    org = models.ForeignKey(
        "orgs.Organization", null=True, blank=True, on_delete=models.PROTECT, related_name="hosts"
    )
    enrolment = models.ForeignKey(
        EnrolmentToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="hosts"
    )
    labels = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=HostStatus.choices, default=HostStatus.ACTIVE)
    agent_token_hash = models.CharField(max_length=64, blank=True, editable=False)
    # What it has (as its agent reported it): what its slots may take.
    cpus = models.PositiveIntegerField(default=1)
    memory_mb = models.PositiveIntegerField(default=1024)
    disk_gb = models.PositiveIntegerField(default=0)
    gpus = models.PositiveIntegerField(default=0)
    arch = models.CharField(max_length=32, blank=True)
    agent_version = models.CharField(max_length=32, blank=True)
    # The slots its agent last said it runs (instance ids), and when.
    running = models.JSONField(default=list, blank=True)
    # Cordoned: no new slot; draining: cordoned, and its jobs requeued once this passes.
    cordoned_at = models.DateTimeField(null=True, blank=True)
    drain_deadline = models.DateTimeField(null=True, blank=True)
    # For cost attribution only (Catacloud never bills it per hour): what the host costs a month.
    monthly_price = models.DecimalField(
        max_digits=12, decimal_places=2, null=True, blank=True, validators=[MinValueValidator(0)]
    )
    enrolled_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    status_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        indexes = [
            models.Index(
                fields=["agent_token_hash"], name="host_agent_token", condition=~Q(agent_token_hash="")
            ),
            # The reaper: WHERE status = 'active' AND last_seen_at < now() - deadline
            models.Index(fields=["status", "last_seen_at"], name="host_status_seen"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def cordoned(self) -> bool:
        return self.cordoned_at is not None


class BudgetPeriod(models.TextChoices):
    MONTH = "month", "calendar month (UTC)"
    DAY = "day", "calendar day (UTC)"


class Budget(models.Model):
    """A money limit per org (optionally per machine type) and calendar month or day, in the
    currency of the price list. Placement and pool refills buy no machine that would pass it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="budgets")
    # Null: every machine type of the org.
    machine_type = models.ForeignKey(
        MachineType, null=True, blank=True, on_delete=models.CASCADE, related_name="budgets"
    )
    amount = models.DecimalField(max_digits=14, decimal_places=2, validators=[MinValueValidator(0)])
    period = models.CharField(max_length=8, choices=BudgetPeriod.choices, default=BudgetPeriod.MONTH)
    # The highest threshold (80, 100) already announced by an event in ``alerted_period``.
    alerted_level = models.PositiveSmallIntegerField(default=0, editable=False)
    alerted_period = models.DateField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["org__slug", "period"]
        constraints = [
            models.UniqueConstraint(
                fields=["org", "machine_type", "period"], name="budget_unique", nulls_distinct=False
            ),
            models.CheckConstraint(condition=Q(amount__gte=0), name="budget_amount_non_negative"),
        ]

    def __str__(self) -> str:
        scope = self.machine_type.name if self.machine_type is not None else "all machine types"
        return f"{self.org}: {self.amount} per {self.period} ({scope})"
