"""Who did something, as events, reasons and the console show it: one spelling per kind.

``Actor`` is a ``str`` (it is stored as the events' ``actor`` and in reasons), made only by the
names and constructors below, so mypy refuses a free-text actor at every service that records
one, and the same actor renders the same way everywhere.
"""

from __future__ import annotations

from typing import ClassVar


class Actor(str):
    __slots__ = ()

    # The system's own parts.
    UNNAMED: ClassVar[Actor]
    REAPER: ClassVar[Actor]  # the periodic safety net (apps/control/reaper.py)
    SCHEDULER: ClassVar[Actor]  # admission and placement
    REFILL: ClassVar[Actor]  # a pool's refill
    PROVISIONER: ClassVar[Actor]  # a machine's creation at its provider
    TERMINATOR: ClassVar[Actor]  # a machine's destruction at its provider
    RECONCILER: ClassVar[Actor]  # the cloud-to-database reconciler
    ACQUIRER: ClassVar[Actor]  # a job's resources being acquired
    RELEASER: ClassVar[Actor]  # a job's resources being released
    AGENT: ClassVar[Actor]  # an agent not yet known as a machine
    CATALOG: ClassVar[Actor]  # `manage.py apply`
    MANAGE: ClassVar[Actor]  # another management command
    MAKE_DEV: ClassVar[Actor]  # `make dev` itself
    API_TOKEN_WELL: ClassVar[Actor]  # the api_token well
    GITHUB: ClassVar[Actor]  # GitHub's deliveries and the GitHub app's own work
    GITHUB_RECONCILER: ClassVar[Actor]  # the GitHub reconciler
    GITLAB: ClassVar[Actor]  # GitLab's deliveries and the GitLab app's own work
    GITLAB_RECONCILER: ClassVar[Actor]  # the GitLab reconciler
    TESTKIT: ClassVar[Actor]  # the test kit and the benchmarks
    BUDGET: ClassVar[Actor]  # a budget's own alert
    ADMIN: ClassVar[Actor]  # the admin, before it knows who (replaced by admin(username))

    @classmethod
    def user(cls, username: str, token_prefix: str | None = None) -> Actor:
        """A user of the API (``user:alice``, ``user:alice token:cc_ab12``)."""
        return cls(f"user:{username}" + (f" token:{token_prefix}" if token_prefix else ""))

    @classmethod
    def admin(cls, username: str) -> Actor:
        """An operator in the Django admin (``admin:root``)."""
        return cls(f"admin:{username}")

    @classmethod
    def agent(cls, instance_id: object) -> Actor:
        """A machine's agent (``agent:<instance id>``)."""
        return cls(f"agent:{instance_id}")

    @classmethod
    def host(cls, host_id: object) -> Actor:
        """An enrolled host's agent (``host:<host id>``)."""
        return cls(f"host:{host_id}")

    @classmethod
    def schedule(cls, name: object) -> Actor:
        """A pool's schedule (``schedule:<name or id>``)."""
        return cls(f"schedule:{name}")

    @classmethod
    def github(cls, source: str) -> Actor:
        """A part of the GitHub integration (``github:<source>``)."""
        return cls(f"github:{source}")

    @classmethod
    def gitlab(cls, source: str) -> Actor:
        """A part of the GitLab integration (``gitlab:<source>``)."""
        return cls(f"gitlab:{source}")


Actor.UNNAMED = Actor("")
Actor.REAPER = Actor("reaper")
Actor.SCHEDULER = Actor("scheduler")
Actor.REFILL = Actor("refill")
Actor.PROVISIONER = Actor("provisioner")
Actor.TERMINATOR = Actor("terminator")
Actor.RECONCILER = Actor("reconciler")
Actor.ACQUIRER = Actor("acquirer")
Actor.RELEASER = Actor("releaser")
Actor.AGENT = Actor("agent")
Actor.CATALOG = Actor("catalog")
Actor.MANAGE = Actor("manage.py")
Actor.MAKE_DEV = Actor("make dev")
Actor.API_TOKEN_WELL = Actor("api_token well")
Actor.GITHUB = Actor("github")
Actor.GITHUB_RECONCILER = Actor("github:reconciler")
Actor.GITLAB = Actor("gitlab")
Actor.GITLAB_RECONCILER = Actor("gitlab:reconciler")
Actor.TESTKIT = Actor("testkit")
Actor.BUDGET = Actor("budget")
Actor.ADMIN = Actor("admin")
