"""
twistd entry point: C{twistd -n blazar [--config PATH]}.
"""

from __future__ import annotations

import os

from twisted.application.service import IService
from twisted.python import usage

from blazar.config import ConfigError


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
        from blazar.service import thd_startup_config

        try:
            # reads the draft models' GGUF headers: blocking, and allowed here, before the reactor runs
            self["parsed"] = thd_startup_config(self["config"], os.environ)
        except ConfigError as e:
            raise usage.UsageError(str(e)) from None


def makeService(options: Options) -> IService:
    """
    Build the service tree for twistd.
    """
    from twisted.internet import reactor

    from blazar.service import make_service

    return make_service(options["parsed"], reactor, dict(os.environ))
