"""
The daemon under cProfile with a CPU clock (C{time.process_time}): time a
request spends waiting (on the engine, on the network) is not counted.

    cprofile_serve.py CONFIG OUT

SIGUSR1 starts a new profile, SIGUSR2 stops it and writes the stats to OUT
(pstats format); the bench sends both around the requests it profiles.
"""

import cProfile
import signal
import sys
import time

from twisted.scripts.twistd import run

config, out = sys.argv[1], sys.argv[2]
profile = cProfile.Profile(time.process_time)


def start(*_: object) -> None:
    global profile
    profile = cProfile.Profile(time.process_time)  # each profile on its own
    profile.enable()


def dump(*_: object) -> None:
    profile.disable()
    profile.dump_stats(out)


signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, dump)
try:
    import blazar.logtext  # noqa: F401  (as blazar serve runs it, where there is one)

    logger = ["--logger=blazar.logtext.observer"]
except ImportError:
    logger = []
sys.argv = ["twistd", "--nodaemon", "--pidfile=", *logger, "blazar", "--config", config]
run()
