"""
The engine failures: the supervisor's (the gateway's error table,
L{blazar.gateway.errors}, gives each its status and wording per surface)
and an engine install's (L{blazar.engines.installed}, L{blazar.engines.build}).
"""

from __future__ import annotations


class EngineError(Exception):
    """
    Base of engine failures; surfaces answer these with 502.

    @ivar model: The model's canonical name.
    """

    def __init__(self, model: str, message: str) -> None:
        self.model = model
        super().__init__(message)


class EngineStartFailed(EngineError):
    """
    A child exited, or never became ready, while starting.
    """


class UnloadedWhileLoading(EngineStartFailed):
    """
    A child was stopped on purpose (an unload, an eviction) before it was
    ready: the requests that waited for it wait for a fresh one
    (L{Supervisor.instance_for}), unless Blazar is shutting down.
    """


class UnknownArchitecture(EngineStartFailed):
    """
    A child died at load saying llama.cpp does not know the model's
    architecture (L{blazar.engines.lanes.unknown_architecture}).
    """

    def __init__(self, model: str, message: str, architecture: str, lane: str) -> None:
        super().__init__(model, message)
        self.architecture = architecture
        self.lane = lane


class EngineCrashed(EngineError):
    """
    A child died (or its connection broke) while serving a request.
    """


class EngineTimeout(EngineError):
    """
    A child stopped answering (surfaces answer 504).
    """


class NoCapacity(EngineError):
    """
    A model cannot be loaded without evicting a busy one, or does not fit
    in memory at all (surfaces answer 503). The message names the levers.
    """


class BreakerOpen(EngineError):
    """
    The model's child crashed too often lately; requests fail fast until the
    back-off ends (surfaces answer 503).

    @ivar retry_after: Seconds until a trial start is allowed.
    """

    def __init__(self, model: str, message: str, retry_after: float) -> None:
        super().__init__(model, message)
        self.retry_after = retry_after


class EngineInstallError(Exception):
    """
    An install, switch or removal refused or failed; the message says why
    and what to run instead.
    """
