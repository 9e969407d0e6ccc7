"""What every forge's console pages share: a form that saves through the services."""

from __future__ import annotations

from typing import Any

from django import forms
from django.db import transaction

from apps.core.actors import Actor
from apps.core.errors import DomainError


class ThroughService(forms.ModelForm):
    """A form whose clean() saves through the service (inside its own savepoint), so a refusal
    shows on the form and nothing is half-written; the admin's save then has nothing to do."""

    actor = Actor.ADMIN
    saved: Any = None

    def save_through_service(self) -> Any:  # pragma: no cover - each form defines it
        raise NotImplementedError

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            with transaction.atomic():
                self.saved = self.save_through_service()
        except DomainError as exc:
            raise forms.ValidationError(exc.detail) from None
        return data
