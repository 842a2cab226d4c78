"""EC2 spot interruption notices through IMDSv2.

Every ``poll_seconds``: PUT ``/latest/api/token`` for a session token (reused until
it nears expiry or is refused), then GET ``/latest/meta-data/spot/instance-action``.
404 means no notice; a 200 is a notice and starts a drain. The base URL comes from
settings (tests run a local imitation); an empty one disables polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger(__name__)

_TOKEN_TTL_S = 21600
_HTTP_TIMEOUT_S = 2.0


class SpotPoller:
    """Polls IMDSv2 for a spot interruption notice; calls ``on_notice(body)`` once."""

    def __init__(
        self, base_url: str, poll_seconds: float, on_notice: Callable[[str], None]
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.poll_seconds = poll_seconds
        self.on_notice = on_notice
        self._token: str | None = None
        self._token_expiry = 0.0
        self._failures = 0

    async def run(self) -> None:
        """Poll until a notice arrives (then return) or the task is cancelled."""
        while True:
            try:
                notice = await asyncio.to_thread(self.check_once)
            except (OSError, urllib.error.URLError) as exc:
                self._failures += 1
                if self._failures in (1, 10) or self._failures % 100 == 0:
                    log.info("spot metadata at %s unreachable (%s)", self.base_url, exc)
                notice = None
            if notice is not None:
                log.warning("spot interruption notice: %s", notice)
                self.on_notice(notice)
                return
            await asyncio.sleep(self.poll_seconds)

    def check_once(self) -> str | None:
        """One blocking poll: the notice body, or None when there is none (404)."""
        token = self._get_token()
        req = urllib.request.Request(
            f"{self.base_url}/latest/meta-data/spot/instance-action",
            headers={"X-aws-ec2-metadata-token": token},
        )
        try:
            with urllib.request.urlopen(req, timeout=_HTTP_TIMEOUT_S) as resp:
                self._failures = 0
                return resp.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                self._failures = 0
                return None
            if exc.code == 401:
                self._token = None
            raise

    def _get_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expiry:
            return self._token
        req = urllib.request.Request(
            f"{self.base_url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(req, timeout=_HTTP_TIMEOUT_S) as resp:
            self._token = resp.read().decode("ascii").strip()
        self._token_expiry = time.monotonic() + _TOKEN_TTL_S - 60
        return self._token
