"""Billing-aware retention: keep an idle machine while the period already paid for lasts."""

from __future__ import annotations

from catacloud.policy.billing import Billing


def should_retire(*, billing: Billing, runtime_seconds: float, margin_seconds: float) -> bool:
    """Retire an idle machine once less than ``margin_seconds`` of its paid period is left.

    The margin covers the time until the next check (the reaper's interval), so the machine
    is gone before the next period (an hour on Hetzner) starts.
    """
    return billing.seconds_left_in_paid_period(runtime_seconds) <= margin_seconds
