"""Spot interruption notices from the machine's instance metadata service.

``--imds-kind ec2`` (:class:`SpotWatcher`): a thread polls ``{imds}/latest/meta-data/spot/instance-action``
every ~2 s with an IMDSv2 session token (``PUT {imds}/latest/api/token``). 404 means no notice;
200 carries the notice.

``--imds-kind azure`` (:class:`ScheduledEventsWatcher`): a thread polls Azure's Scheduled Events,
``GET {imds}/metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``, every
second as Microsoft recommends; a ``Preempt`` event whose ``Resources`` names this VM (its name
from ``{imds}/metadata/instance/compute/name``) is the notice, at least 30 s before the eviction
(https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events).

Either way the notice is handed once to ``on_notice`` (the agent posts it to the Agent API, which
requeues the job).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import requests

from catacloud.agent.client import redact

log = logging.getLogger("catacloud.agent")

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_SECONDS = 21600

EVENTS_PATH = "/metadata/scheduledevents"
EVENTS_API_VERSION = "2020-07-01"
NAME_PATH = "/metadata/instance/compute/name"
INSTANCE_API_VERSION = "2021-02-01"
# "You should expect a delayed response in your first call of up to two minutes" (the first call
# enables Scheduled Events for the VM): the first look may take that long, later ones may not.
FIRST_CALL_TIMEOUT = 130.0
KINDS = ("ec2", "azure")
# What a running job gets to write its checkpoint after a notice, where the default (30 s, of
# EC2's two minutes) would not fit: Azure gives at least 30 s, best effort, and the checkpoint's
# upload and the report need the rest.
NOTICE_GRACE_SECONDS = {"azure": 15.0}


class SpotWatcher:
    """Polls EC2's IMDS until a spot interruption notice is delivered, or ``stop`` is set."""

    name = "spot-watcher"

    def __init__(
        self,
        imds_url: str,
        on_notice: Callable[[str], None],
        *,
        stop: threading.Event,
        interval: float = 2.0,
        request_timeout: float = 2.0,
    ) -> None:
        self.base = imds_url.rstrip("/")
        self.on_notice = on_notice
        self.stop = stop
        self.interval = interval
        self.request_timeout = request_timeout
        self._session = requests.Session()
        self._session.trust_env = False  # the metadata service is link-local: never via a proxy
        self._token: str | None = None
        self._token_expires = 0.0
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.delivered = False

    def start(self) -> None:
        self._thread.start()

    def _get_token(self) -> str:
        if self._token is None or time.monotonic() >= self._token_expires:
            response = self._session.put(
                self.base + TOKEN_PATH,
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_SECONDS)},
                timeout=self.request_timeout,
            )
            response.raise_for_status()
            self._token = response.text.strip()
            self._token_expires = time.monotonic() + TOKEN_TTL_SECONDS - 60
        return self._token

    def check(self) -> str | None:
        """One look: the notice's text, or ``None`` when there is none."""
        for _ in range(2):
            response = self._session.get(
                self.base + ACTION_PATH,
                headers={"X-aws-ec2-metadata-token": self._get_token()},
                timeout=self.request_timeout,
            )
            if response.status_code == 401:  # the session token expired or was rejected
                self._token = None
                continue
            if response.status_code == 404:
                return None
            response.raise_for_status()
            return response.text
        return None

    def _run(self) -> None:
        failures = 0
        while not self.stop.is_set():
            try:
                notice = self.check()
            except requests.RequestException as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("spot watcher: IMDS unreachable (%s)", redact(str(exc)))
                notice = None
            else:
                failures = 0
            if notice is not None:
                log.warning("spot interruption notice: %s", notice.strip())
                try:
                    self.on_notice(notice)
                except Exception as exc:
                    log.warning("could not report the spot interruption: %s", redact(str(exc)))
                else:
                    self.delivered = True
                    return
            self.stop.wait(self.interval)


class ScheduledEventsWatcher(SpotWatcher):
    """Polls Azure's Scheduled Events until this VM's ``Preempt`` event is delivered.

    It never approves the event (a ``StartRequests`` POST): approving "indicates to Azure that it
    can shorten the minimum notification time", and the job needs every one of the 30 seconds to
    write its checkpoint. The notice is the event itself, as JSON."""

    name = "scheduled-events-watcher"

    def __init__(
        self,
        imds_url: str,
        on_notice: Callable[[str], None],
        *,
        stop: threading.Event,
        interval: float = 1.0,  # "we recommend that you poll the service once per second"
        request_timeout: float = 2.0,
    ) -> None:
        super().__init__(imds_url, on_notice, stop=stop, interval=interval, request_timeout=request_timeout)
        self._vm_name: str | None = None
        self._answered = False  # the first answer can take up to two minutes

    def _get(self, path: str, **params: str) -> requests.Response:
        # IMDS refuses a request without "Metadata: true" (and one with X-Forwarded-For).
        timeout = self.request_timeout if self._answered else FIRST_CALL_TIMEOUT
        headers = {"Metadata": "true"}
        response = self._session.get(self.base + path, params=params, headers=headers, timeout=timeout)
        response.raise_for_status()
        return response

    def vm_name(self) -> str:
        if self._vm_name is None:
            response = self._get(NAME_PATH, **{"api-version": INSTANCE_API_VERSION, "format": "text"})
            self._vm_name = response.text.strip()
        return self._vm_name

    def check(self) -> str | None:
        name = self.vm_name()
        document: dict[str, Any] = self._get(EVENTS_PATH, **{"api-version": EVENTS_API_VERSION}).json()
        self._answered = True
        for event in document.get("Events") or []:
            resources = [str(r).lower() for r in event.get("Resources") or []]
            if event.get("EventType") == "Preempt" and name.lower() in resources:
                return json.dumps(event, sort_keys=True)
        return None


def spot_watcher(
    kind: str, imds_url: str, on_notice: Callable[[str], None], *, stop: threading.Event
) -> SpotWatcher:
    """The watcher for ``--imds-kind``: ``ec2`` or ``azure``."""
    if kind == "azure":
        return ScheduledEventsWatcher(imds_url, on_notice, stop=stop)
    if kind == "ec2":
        return SpotWatcher(imds_url, on_notice, stop=stop)
    raise ValueError(f"unknown IMDS kind {kind!r}; known: {', '.join(KINDS)}")
