"""A catalog's machine types against what their providers sell: ``manage.py apply`` asks each
Hetzner, AWS or Azure account for its server types, images and locations (one list call of each kind)
and refuses a catalog naming one that does not exist there, before anything is written.

No transaction is open during these calls: the catalog is first applied and rolled back (which
validates it and gathers what to ask), then checked, then applied for real.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from catacloud.providers import Offering, OfferingProblem, ProviderError, build_provider, get_driver_class


@dataclass
class AccountOfferings:
    """What one provider account of a catalog is asked for, and by which machine types."""

    kind: str
    config: Mapping[str, Any]
    credentials: Mapping[str, str]
    # (offering, machine type name, its line in the catalog)
    wanted: list[tuple[Offering, str, int | None]] = field(default_factory=list)


def checks_offerings(kind: str) -> bool:
    """Whether accounts of ``kind`` sell from a list worth checking (hetzner, aws; not local)."""
    return get_driver_class(kind).checks_offerings


@dataclass(frozen=True)
class Finding:
    """One problem of one machine type, with where the catalog names it."""

    account: str
    machine_type: str
    line: int | None
    problem: OfferingProblem

    def __str__(self) -> str:
        where = f"line {self.line}, " if self.line else ""
        return f"{where}machine type {self.machine_type} (account {self.account}): {self.problem.message}"


class OfferingsUnchecked(Exception):
    """A provider could not be asked (a wrong credential, its API unreachable)."""


def offerings_check(accounts: Mapping[str, AccountOfferings]) -> list[Finding]:
    """Every problem of every account's offerings, refusals and warnings alike."""
    findings: list[Finding] = []
    for name, account in accounts.items():
        offerings = list(dict.fromkeys(offering for offering, _, _ in account.wanted))
        try:
            provider = build_provider(account.kind, config=account.config, credentials=account.credentials)
            problems = provider.check_offerings(offerings)
        except ProviderError as exc:
            raise OfferingsUnchecked(f"account {name}: {exc}") from exc
        for problem in problems:
            findings += [
                Finding(name, machine_type, line, problem)
                for offering, machine_type, line in account.wanted
                if offering == problem.offering
            ]
    return sorted(findings, key=lambda f: (f.line or 0, f.machine_type))
