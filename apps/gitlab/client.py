"""The one GitLab client: every call Catacloud makes to GitLab (GitLab.com or self-managed, REST
API v4) goes through :class:`GitLabClient`, the CI core's client machinery
(apps.ci.client.ForgeClient: ``RateLimit-*`` and ``Retry-After`` honoured, retries, the
per-connection request budget ``CATACLOUD_GITLAB_REQUEST_BUDGET``, GitLab paused and runner jobs
held while it fails) authenticated with the connection's access token (``PRIVATE-TOKEN``).

Why not python-gitlab: Catacloud calls seven endpoints, and each call must go through the one
budget, the availability pause and the rate-limit bookkeeping every forge shares; python-gitlab
would be wrapped call by call for that (its own retries sleep in the worker on 429), so the
core's client is the simpler one client for both forges. Never logs a token or a body.
"""

from __future__ import annotations

from typing import Any

from apps.ci.client import ForgeClient
from apps.ci.errors import ForgeNotFound
from apps.gitlab.forge import GITLAB
from apps.gitlab.models import GitLabConnection


class GitLabClient(ForgeClient):
    """Calls to one connection's GitLab."""

    forge = GITLAB
    remaining_header = "ratelimit-remaining"
    reset_header = "ratelimit-reset"
    limit_statuses = (429,)

    def __init__(self, connection: GitLabConnection) -> None:
        self.connection = connection
        super().__init__(connection)

    def base_url(self) -> str:
        return self.connection.api_url

    def headers(self, auth: str) -> dict[str, str]:
        return {
            "Accept": "application/json",
            "User-Agent": "catacloud",
            "PRIVATE-TOKEN": self.connection.token,
        }

    # ---- the endpoints Catacloud uses -------------------------------------------------------

    def create_runner(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /user/runners``: a project or group runner; answers its id and ``glrt-`` token."""
        return dict(self.request("POST", "/user/runners", json=body))

    def delete_runner(self, runner_id: int, *, background: bool = False) -> bool:
        """``DELETE /runners/:id``; False when it was already gone (404)."""
        try:
            self.request("DELETE", f"/runners/{runner_id}", background=background)
        except ForgeNotFound:
            return False
        return True

    def pause_runner(self, runner_id: int) -> None:
        """``PUT /runners/:id`` paused: it takes no job any more."""
        self.request("PUT", f"/runners/{runner_id}", json={"paused": True})

    def runner_jobs(self, runner_id: int, *, status: str) -> list[dict[str, Any]]:
        answer = self.request("GET", f"/runners/{runner_id}/jobs", params={"status": status, "per_page": 20})
        return answer if isinstance(answer, list) else []

    def runners(self) -> list[dict[str, Any]]:
        """``GET /runners``: the runners the token's user owns (project and group runners)."""
        return self.paged("/runners", None, background=True)

    def project_jobs(self, project_id: int, scopes: list[str]) -> list[dict[str, Any]]:
        return self.paged(f"/projects/{project_id}/jobs", None, params={"scope[]": scopes}, background=True)

    def job(self, project_id: int, job_id: int, *, background: bool = True) -> dict[str, Any]:
        return dict(self.request("GET", f"/projects/{project_id}/jobs/{job_id}", background=background))
