"""What a forge call can come to: one hierarchy for every forge's client (GitHub's names are
aliases of these), so the core's dispatch and reconciler handle each forge's failures alike."""

from __future__ import annotations


class ForgeError(Exception):
    """A forge call failed. ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, detail: str, status: int = 0) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


class ForgeUnavailable(ForgeError):
    """The forge did not answer usefully (connection, timeout, 5xx), or is known to be down."""


class ForgeRateLimited(ForgeError):
    """A rate limit (the forge's, or our own budget): wait ``retry_after`` seconds.

    ``secondary``: the forge's answer was a secondary limit (GitHub: wait at least a minute,
    longer when repeated). ``paced``: our own pacing below a documented limit (or a quota the
    forge keeps, like GitLab's runner cap) refused the call before it was made: only what needs
    that limit waits (a runner registration), not every call to the endpoint."""

    def __init__(
        self,
        detail: str,
        retry_after: float,
        status: int = 0,
        *,
        secondary: bool = False,
        paced: bool = False,
        scoped: bool = False,
    ) -> None:
        super().__init__(detail, status)
        self.retry_after = retry_after
        self.secondary = secondary
        self.paced = paced
        # The limit is one project's or group's (GitLab's runner cap), not the endpoint's: only
        # that runner waits.
        self.scoped = scoped


class ForgeRefused(ForgeError):
    """A 4xx answer: the request is wrong for the forge (configuration, permissions, state)."""


class ForgeNotFound(ForgeRefused):
    pass


class ForgeConflict(ForgeRefused):
    """409: e.g. a runner with this name exists already."""


class ForgeUnprocessable(ForgeRefused):
    """422: e.g. a busy runner cannot be deleted."""


class ForgeBusy(ForgeError):
    """The runner to retire is running a job (the forge gave it one a moment ago)."""


def refused(status: int, detail: str) -> ForgeRefused:
    kind = {404: ForgeNotFound, 409: ForgeConflict, 422: ForgeUnprocessable}.get(status, ForgeRefused)
    return kind(detail, status)
