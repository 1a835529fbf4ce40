"""
twistd entry point: C{twistd -n blazar [--config PATH]}.
"""

from __future__ import annotations

import os

from twisted.application.service import IService
from twisted.python import usage

from blazar.config import ConfigError, resolve_config


class Options(usage.Options):
    """
    Flags for C{twistd blazar}. The config is read and checked here, so a
    bad config makes twistd exit non-zero with the message before anything
    starts.
    """

    optParameters = [
        [
            "config",
            "c",
            None,
            "Path to config.toml (default: $BLAZAR_CONFIG, else ~/.config/blazar/config.toml).",
        ],
    ]

    def postOptions(self) -> None:
        from blazar.models.speculative import thd_check_drafts

        try:
            self["parsed"] = resolve_config(self["config"])
            # reads the draft models' GGUF headers: blocking, and allowed here, before the reactor runs
            thd_check_drafts(self["parsed"])
        except ConfigError as e:
            raise usage.UsageError(str(e)) from None
        from blazar.web.auth import keys_from_env

        try:
            keys_from_env(os.environ.get("BLAZAR_KEYS"))
        except ValueError as e:
            raise usage.UsageError(str(e)) from None


def makeService(options: Options) -> IService:
    """
    Build the service tree for twistd.
    """
    from twisted.internet import reactor

    from blazar.service import make_service

    return make_service(options["parsed"], reactor, dict(os.environ))
