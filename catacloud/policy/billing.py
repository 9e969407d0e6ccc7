"""How providers bill a machine, from the machine type's increment and minimum.

Hetzner bills every started hour (increment 3600, minimum 0 → the first second costs an
hour); EC2 bills per second after a 60-second minimum (increment 1, minimum 60).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True)
class Billing:
    increment_seconds: int
    min_billed_seconds: int
    price_per_hour: Decimal

    def billed_seconds(self, runtime_seconds: float) -> int:
        """Seconds the provider charges for a machine that lived ``runtime_seconds``."""
        runtime = max(0.0, runtime_seconds)
        periods = max(1, math.ceil(runtime / self.increment_seconds))
        return max(self.min_billed_seconds, periods * self.increment_seconds)

    def cost(self, runtime_seconds: float) -> Decimal:
        return (Decimal(self.billed_seconds(runtime_seconds)) * self.price_per_hour / Decimal(3600)).quantize(
            Decimal("0.000001")
        )

    def paid_until(self, runtime_seconds: float) -> int:
        """Age (seconds since start) at which the period already paid for ends.

        A machine that is this old or older starts a new billed period; an idle machine is
        worth keeping for the next job only until shortly before this age.
        """
        return self.billed_seconds(runtime_seconds)

    def seconds_left_in_paid_period(self, runtime_seconds: float) -> float:
        return self.paid_until(runtime_seconds) - max(0.0, runtime_seconds)
