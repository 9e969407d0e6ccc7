"""The driver of enrolled hosts' slots (provider kind ``hosts``): nothing is bought or deleted.

A slot's host is chosen when the slot is requested (apps.machines.hosts.slot_host, under the
grant's and the hosts' locks); this driver only answers the provider interface from what the
hosts report, so the life cycle, the reaper and the reconciler treat a slot as any machine:

- ``create``: the slot exists once its host is told to start it (its next exchange, woken now);
  the provider id is the instance id.
- ``get`` / ``list``: a slot its host reports running is running; one its host has not started
  yet is provisioning; one whose host is lost, revoked or no longer reports it is gone (the
  reconciler then marks its row lost and requeues its job, as for a vanished cloud machine).
- ``delete``: the host stops a slot whose row is no longer live at its next exchange (woken now).

Registered under ``hosts`` by the machines app (``apps.machines.apps``): it reads the database,
so it lives with the models, not in the framework-free ``catacloud.providers``.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, ClassVar

from django.utils import timezone

from catacloud.providers.base import (
    LABEL_INSTANCE,
    LABEL_ORG,
    LABEL_POOL,
    MachineSpec,
    MachineState,
    NotFound,
    Provider,
    ProviderMachine,
    machine_name,
)


class HostsProvider(Provider):
    kind = "hosts"
    STATE_MAP: ClassVar[Mapping[str, MachineState]] = {
        "starting": MachineState.PROVISIONING,
        "running": MachineState.RUNNING,
        "stopped": MachineState.GONE,
    }

    def create(self, spec: MachineSpec) -> ProviderMachine:
        from apps.machines.hosts import host_wake
        from apps.machines.models import MachineInstance

        row = MachineInstance.objects.filter(pk=spec.instance_id).values("host_id").first()
        if row is None or row["host_id"] is None:
            from catacloud.providers.base import Permanent

            raise Permanent("a slot of an enrolled host needs its host, chosen when it was requested")
        host_wake(row["host_id"])
        return self._machine(spec.instance_id, dict(spec.labels), "starting")

    def get(self, provider_id: str) -> ProviderMachine:
        found = self._slots(pk=provider_id)
        if not found:
            raise NotFound(f"no slot {provider_id}")
        return found[0]

    def list(self, owner_labels: Mapping[str, str]) -> builtins.list[ProviderMachine]:
        return [
            m
            for m in self._slots(provider_account_id=self.config.get("account_id"))
            if owner_labels.items() <= m.labels.items() and m.state is not MachineState.GONE
        ]

    def delete(self, provider_id: str) -> None:
        from apps.machines.hosts import host_wake
        from apps.machines.models import MachineInstance

        row = MachineInstance.objects.filter(pk=provider_id).values("host_id").first()
        if row is not None and row["host_id"] is not None:
            host_wake(row["host_id"])

    # ---- from the hosts' reports ---------------------------------------------------------------

    def _slots(self, **where: Any) -> builtins.list[ProviderMachine]:
        from apps.machines.choices import INSTANCE_LIVE, HostStatus
        from apps.machines.lifecycle import owner_labels
        from apps.machines.models import MachineInstance

        where = {k: v for k, v in where.items() if v is not None}
        rows = MachineInstance.objects.filter(host__isnull=False, **where).values(
            "pk", "org_id", "pool_id", "status", "created_at", "host__status", "host__running"
        )
        machines = []
        for row in rows:
            slot_id = str(row["pk"])
            if row["host__status"] == HostStatus.ACTIVE and slot_id in (row["host__running"] or []):
                raw = "running"
            elif row["host__status"] == HostStatus.ACTIVE and row["status"] in INSTANCE_LIVE:
                raw = "starting"
            else:
                raw = "stopped"
            labels = {
                **owner_labels(),
                LABEL_INSTANCE: slot_id,
                LABEL_ORG: str(row["org_id"]),
                LABEL_POOL: str(row["pool_id"]) if row["pool_id"] else "none",
            }
            machines.append(self._machine(slot_id, labels, raw, created_at=row["created_at"]))
        return machines

    def _machine(
        self, slot_id: str, labels: dict[str, str], raw: str, created_at: Any = None
    ) -> ProviderMachine:
        return ProviderMachine(
            provider_id=slot_id,
            name=machine_name(slot_id),
            state=self.map_state(raw),
            labels=labels,
            created_at=created_at or timezone.now(),
            raw_state=raw,
        )
