"""Thin tasks shared by the forges: each takes a forge's name, calls one service, and is safe to
run twice."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from apps.ci.availability import held_release
from apps.ci.forge import forge_named


@shared_task(ignore_result=True)
def held_release_task(forge_name: str) -> None:
    """The wait of runner jobs a limit held is over: admission takes them again."""
    forge = forge_named(forge_name)
    if forge is not None:
        held_release(forge=forge, now=timezone.now())
