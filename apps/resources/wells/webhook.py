"""``webhook``: your own create and destroy URLs, so any system plugs in without code.

Config: ``create_url``, ``destroy_url``, optional ``timeout`` (s) and ``headers_env`` (name of
an environment variable holding a JSON object of extra headers, e.g. an Authorization header;
never stored in the database). Create: ``POST create_url {"resource_id", "job_id", "org"}`` →
2xx ``{"id": ..., "metadata": {...}, "secret": {...}}``. Destroy: ``POST destroy_url
{"resource_id", "id", "job_id"}`` → 2xx (404 counts as done). 5xx, 429 and network errors are
retried with backoff until they succeed; other 4xx are permanent.
"""

from __future__ import annotations

import json
import os
from typing import Any

import requests

from apps.resources.wells import Created, Well, WellPermanent, WellTransient


class WebhookWell(Well):
    kind = "webhook"

    def _post(self, url_key: str, body: dict[str, Any]) -> requests.Response:
        url = self.config.get(url_key)
        if not url:
            raise WellPermanent(f"webhook well needs {url_key}")
        headers = {"Content-Type": "application/json"}
        if self.config.get("headers_env"):
            headers.update(json.loads(os.environ.get(str(self.config["headers_env"]), "{}")))
        try:
            response = requests.post(
                url, json=body, headers=headers, timeout=float(self.config.get("timeout", 30))
            )
        except requests.RequestException as exc:
            raise WellTransient(f"{url_key}: {type(exc).__name__}") from None
        if response.status_code >= 500 or response.status_code == 429:
            raise WellTransient(f"{url_key} answered {response.status_code}")
        return response

    def create(self, *, resource_id: str, job: Any) -> Created:
        response = self._post(
            "create_url", {"resource_id": resource_id, "job_id": str(job.pk), "org": job.org.slug}
        )
        if not response.ok:
            raise WellPermanent(f"create_url answered {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            raise WellPermanent("create_url did not answer JSON") from None
        return Created(
            external_id=str(body.get("id", resource_id)),
            metadata=dict(body.get("metadata") or {}),
            secret=dict(body.get("secret") or {}),
        )

    def destroy(self, *, resource_id: str, external_id: str, job_id: str | None) -> None:
        response = self._post(
            "destroy_url", {"resource_id": resource_id, "id": external_id, "job_id": job_id}
        )
        if not response.ok and response.status_code != 404:
            raise WellPermanent(f"destroy_url answered {response.status_code}")
