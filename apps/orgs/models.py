from __future__ import annotations

import uuid

from django.conf import settings
from django.core.validators import MinLengthValidator
from django.db import models

from apps.core.crypto import decrypt_json, encrypt_json
from apps.orgs.choices import ROLE_RANK, Role


class Privilege(models.Model):
    """A named grant (``gpu``, ``lab``…) that some machine types and resource types require."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Organization(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    slug = models.SlugField(max_length=64, unique=True, validators=[MinLengthValidator(2)])
    name = models.CharField(max_length=200)
    privileges = models.ManyToManyField(Privilege, blank=True, related_name="organizations")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def has_privilege(self, privilege: Privilege | None) -> bool:
        return privilege is None or self.privileges.filter(pk=privilege.pk).exists()


class Membership(models.Model):
    org = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["org", "user"], name="membership_unique")]
        ordering = ["org__slug", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} in {self.org} ({self.role})"

    def allows(self, role: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(role)]


class ApiToken(models.Model):
    """A bearer token acting for one user in one organization. Only its SHA-256 is stored."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_tokens")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True)
    # First characters of the token, to recognise it in lists; not enough to use it.
    prefix = models.CharField(max_length=12, editable=False)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    # A token may be narrower than its user's role; never wider.
    role = models.CharField(max_length=16, choices=Role.choices, blank=True)
    # Narrower than the org, set by the layer that minted the token and opaque here:
    # ``job:<uuid>`` for the api_token well's tokens, which read only that job.
    scope = models.CharField(max_length=64, blank=True, default="", editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user} in {self.org})"


class RegistryCredential(models.Model):
    """An organization's credentials for one container registry host: used only by the agent
    that pulls a job's (or a pool's) image from that host, never shown again (the password is
    write-only, stored encrypted like secret env), never given to a job."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="registry_credentials")
    registry = models.CharField(max_length=255, help_text="host or host:port, as image references name it")
    username = models.CharField(max_length=255)
    password_encrypted = models.TextField(editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["org__slug", "registry"]
        constraints = [
            models.UniqueConstraint(fields=["org", "registry"], name="registry_credential_unique_in_org")
        ]

    def __str__(self) -> str:
        return f"{self.org}: {self.registry}"

    @property
    def password(self) -> str:
        return str(decrypt_json(self.password_encrypted) or "")

    @password.setter
    def password(self, value: str) -> None:
        self.password_encrypted = encrypt_json(value)
