"""Alerts through Apprise (email, Slack, Telegram, a JSON webhook, ... any Apprise URL).

A run notifies on failure, on each recovery of a role, and when it finishes. A notification
that cannot be delivered is logged and never takes the run down.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Alerts:
    def __init__(self, urls: list[str], run_name: str) -> None:
        self.run_name = run_name
        self.apprise = None
        if urls:
            import apprise

            self.apprise = apprise.Apprise()
            for url in urls:
                if not self.apprise.add(url):
                    from rlx.errors import ConfigError

                    raise ConfigError(f"logging.alerts: {url!r} is not an Apprise URL it can use "
                                      "(see https://github.com/caronc/apprise/wiki for the URL forms)")

    def notify(self, event: str, body: str) -> None:
        """`event` is failure, recovery or finished."""
        if self.apprise is None:
            return
        import apprise

        kind = {"failure": apprise.NotifyType.FAILURE, "recovery": apprise.NotifyType.WARNING}.get(
            event, apprise.NotifyType.SUCCESS)
        try:
            delivered = self.apprise.notify(title=f"rlx {self.run_name}: {event}", body=body, notify_type=kind)
        except Exception as exc:  # noqa: BLE001 - a broken notifier must not break training
            log.warning("alert %s could not be sent: %s", event, exc)
            return
        if not delivered:
            log.warning("alert %s could not be delivered to every URL in logging.alerts", event)
