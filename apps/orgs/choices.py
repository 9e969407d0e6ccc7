from __future__ import annotations

from django.db import models


class Role(models.TextChoices):
    ADMIN = "admin", "admin"
    MEMBER = "member", "member"
    VIEWER = "viewer", "viewer"


# What each role may do; higher roles include lower ones.
ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2}
