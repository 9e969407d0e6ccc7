"""Ids at service boundaries: what a parameter named ``*_id`` holds.

Every primary key is a UUID (a resource type's is its slug). Services, hooks and selectors take
these, never ``Any``: a caller holding a string (a task's argument, a URL's part) converts it
where it enters (``UUID(value)``). Aliases, not new types: a model's ``pk`` or ``org_id`` is one.
"""

from __future__ import annotations

from typing import TypeAlias
from uuid import UUID

from django.db.models import Model

OrgId: TypeAlias = UUID
ProviderAccountId: TypeAlias = UUID
MachineTypeId: TypeAlias = UUID
InstanceId: TypeAlias = UUID
ClaimId: TypeAlias = UUID
PoolId: TypeAlias = UUID
JobConfigId: TypeAlias = UUID
JobId: TypeAlias = UUID
ArtifactId: TypeAlias = UUID
ResourceId: TypeAlias = UUID
ResourceTypeId: TypeAlias = str  # a slug (``api_token``, ``postgres_database``)
GitHubInstallationId: TypeAlias = UUID  # our row of a GitHub App installation (not GitHub's id)
RunnerClassId: TypeAlias = UUID
RunnerId: TypeAlias = UUID  # a GitHub runner's row: the id of the Catacloud job it is

# What an event names (its org, pool, instance, job): the row itself or its id (a string where
# the id came from outside, e.g. a cloud label).
RowRef: TypeAlias = Model | UUID | str | None
