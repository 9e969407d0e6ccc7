"""What every forge's console pages share: forms that save through the services, the admin
that shows them, and the parsing of a connection's id list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from django import forms
from django.contrib import admin
from django.db import transaction
from django.http import HttpRequest

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


class RunnerClassForm(ThroughService):
    """A runner class saved through its forge's services, its labels (GitLab: tags) edited as
    one comma-separated text field ``<labels_field>_text``, which each forge's form declares."""

    labels_field: ClassVar[str]
    class_fields: ClassVar[tuple[str, ...]]
    class_save: ClassVar[Callable[..., tuple[Any, bool]]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields[f"{self.labels_field}_text"].initial = ", ".join(
                getattr(self.instance, self.labels_field)
            )

    def save_through_service(self) -> Any:
        data, labels = self.cleaned_data, self.labels_field
        fields = {k: data[k] for k in self.class_fields if k in data and k != labels}
        fields[labels] = [x.strip() for x in data[f"{labels}_text"].split(",") if x.strip()]
        model = self._meta.model
        existing = model._default_manager.filter(pk=self.instance.pk).first() if self.instance.pk else None
        rc, _ = type(self).class_save(org=data["org"], runner_class=existing, actor=self.actor, **fields)
        return rc


def id_pairs(text: str, *, what: str, second_required: bool) -> list[tuple[int, str]]:
    """``12:acme/app, 13`` as ``[(12, "acme/app"), (13, "")]``; a form error names a bad part."""
    out = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        ident, _, second = part.partition(":")
        if not ident.strip().isdigit() or (second_required and not second.strip()):
            raise forms.ValidationError(f"{part!r}: {what}")
        out.append((int(ident), second.strip()))
    return out


class ServiceSavedAdmin(admin.ModelAdmin):
    """A console page whose form saves through the services (:class:`ThroughService`): the
    organization is fixed once saved, the form knows who acts, the admin writes nothing itself."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple:
        return ("org",) if obj is not None else ()

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        form.actor = Actor.admin(request.user.get_username())  # type: ignore[attr-defined]
        return form

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        obj.pk = form.saved.pk  # saved by the form, through the services
        obj._state.adding = False

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        pass
