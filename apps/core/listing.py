"""Lists that say when a query parameter makes no sense, instead of ignoring it.

DRF answers ``?ordering=bogus`` and ``?limit=abc`` as if they were not there, and django-filter
answers ``?status=sucess`` with "Select a valid choice" and no choice. These answer a 400
naming the parameter and what it takes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django import forms
from django.db.models import QuerySet
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework import filters, pagination, serializers
from rest_framework.request import Request
from rest_framework.views import APIView


def _choices(field: forms.Field) -> list[str] | None:
    """The values a fixed choice field takes (not a model choice: those are objects)."""
    if not isinstance(field, forms.ChoiceField) or isinstance(field, forms.ModelChoiceField):
        return None
    return [str(value) for value, _ in field.choices if value not in ("", None)]  # type: ignore[union-attr,misc]


class FilterBackend(DjangoFilterBackend):  # type: ignore[misc]  # django-filter has no types
    """``?status=sucess``: ``status: 'sucess' is not one of queued, acquiring_resources, …``."""

    def filter_queryset(self, request: Request, queryset: QuerySet[Any], view: APIView) -> QuerySet[Any]:
        filterset = self.get_filterset(request, queryset, view)
        if filterset is None:
            return queryset
        if not filterset.is_valid():
            errors: dict[str, list[str]] = {}
            for name, problems in filterset.form.errors.as_data().items():
                field = filterset.form.fields.get(name)
                choices = _choices(field) if field is not None else None
                for problem in problems:
                    value = (problem.params or {}).get("value")
                    if problem.code == "invalid_choice" and choices and value is not None:
                        errors.setdefault(name, []).append(f"{value!r} is not one of {', '.join(choices)}")
                    else:
                        errors.setdefault(name, []).extend(problem.messages)
            raise serializers.ValidationError(errors)
        qs: QuerySet[Any] = filterset.qs
        return qs


class OrderingFilter(filters.OrderingFilter):
    """``?ordering=bogus``: ``ordering: cannot order by 'bogus'; order by created_at, …``."""

    def remove_invalid_fields(
        self, queryset: QuerySet[Any], fields: Iterable[str], view: APIView, request: Request
    ) -> list[str]:
        fields = list(fields)
        valid = super().remove_invalid_fields(queryset, fields, view, request)
        wrong = [term for term in fields if term and term not in valid]
        if wrong:
            names = sorted(
                str(item[0]) for item in self.get_valid_fields(queryset, view, {"request": request})
            )
            them = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
            example = f" (a leading - for descending, e.g. -{names[0]})" if names else ""
            raise serializers.ValidationError(
                {self.ordering_param: [f"cannot order by {wrong[0]!r}; order by {them}{example}"]}
            )
        return valid


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    """``?limit=abc``, ``?limit=0`` and ``?offset=-1`` are a 400, not the default page."""

    def _whole(self, request: Request, name: str, least: int) -> int | None:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            return None
        try:
            value = int(raw)
        except ValueError:
            value = least - 1
        if value < least:
            raise serializers.ValidationError({name: [f"a whole number of at least {least}, got {raw!r}"]})
        return value

    def get_limit(self, request: Request) -> int | None:
        limit = self._whole(request, self.limit_query_param, 1)
        if limit is None:
            return self.default_limit
        return min(limit, self.max_limit) if self.max_limit else limit

    def get_offset(self, request: Request) -> int:
        return self._whole(request, self.offset_query_param, 0) or 0
