"""
What a spawn of an engine child needs besides the supervisor's table: a
free port, the child's environment, its slot directory, and the identity
of the files it loads (L{child_shape}).
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Mapping, Sequence

from blazar.files import private_dir


def thd_identity(*paths: Path) -> str:
    """
    What the files a child is started from are right now (path, size,
    mtime of each): part of L{Instance.shape}.
    """
    parts = []
    for path in paths:
        try:
            st = os.stat(path)
            parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{path}:missing")
    return "\0".join(parts)


def child_shape(identity: str, argv: Sequence[str]) -> str:
    """
    L{Instance.shape}: the files' identity and the command line (without
    the port, which changes with every start), hashed.
    """
    args = list(argv)
    if "--port" in args:
        at = args.index("--port")
        del args[at:at + 2]
    return hashlib.sha256((identity + "\0" + "\0".join(args)).encode("utf-8")).hexdigest()[:32]


def thd_slot_dir(path: Path) -> None:
    """
    Make a model's slot save directory (0700, its parents too) if missing.
    """
    if not path.is_dir():
        private_dir(path.parent)
        private_dir(path)


def free_port() -> int:
    """
    A TCP port on 127.0.0.1 that is free right now.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """
    The base environment for engine children: the daemon's, without any
    C{LLAMA_ARG_*} or C{LLAMA_API_KEY*} variable (those would silently
    change engine flags or keys).
    """
    return {
        k: v for k, v in environ.items()
        if not k.startswith("LLAMA_ARG_") and not k.startswith("LLAMA_API_KEY")
    }
