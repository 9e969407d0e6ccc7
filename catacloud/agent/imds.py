"""Spot interruption notices from the EC2 instance metadata service (IMDSv2).

A thread polls ``{imds}/latest/meta-data/spot/instance-action`` every ~2 s with a session token
(``PUT {imds}/latest/api/token``). 404 means no notice; 200 carries the notice, which is handed
once to ``on_notice`` (the agent posts it to the Agent API, which requeues the job).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import requests

from catacloud.agent.client import redact

log = logging.getLogger("catacloud.agent")

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_SECONDS = 21600


class SpotWatcher:
    """Polls IMDS until a spot interruption notice is delivered, or ``stop`` is set."""

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
        self._thread = threading.Thread(target=self._run, name="spot-watcher", daemon=True)
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
