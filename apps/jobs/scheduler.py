"""One scheduling pass: admission (apps.jobs.admission), then placement (apps.jobs.placement).
Triggered after commit by a submit, a job's end, a machine becoming ready or a quota change;
the reaper runs it as a safety net. Any number may run at once on any number of workers."""

from __future__ import annotations

from dataclasses import dataclass

from apps.jobs.admission import admit
from apps.jobs.placement import place


@dataclass
class ScheduleReport:
    admitted: int = 0
    assigned: int = 0
    provisioned: int = 0
    waiting: int = 0


def schedule(*, limit: int = 500) -> ScheduleReport:
    report = ScheduleReport()
    report.admitted = admit(limit=limit)
    assigned, provisioned, waiting = place(limit=limit)
    report.assigned, report.provisioned, report.waiting = assigned, provisioned, waiting
    return report
