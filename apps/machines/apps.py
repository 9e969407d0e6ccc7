from __future__ import annotations

from django.apps import AppConfig


class MachinesConfig(AppConfig):
    name = "apps.machines"
    label = "machines"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Enrolled hosts' slots: a driver that reads the database, so it lives here, not in the
        # framework-free catacloud.providers (apps.machines.hostdriver).
        from catacloud.providers import DRIVERS

        DRIVERS.setdefault("hosts", "apps.machines.hostdriver.HostsProvider")
