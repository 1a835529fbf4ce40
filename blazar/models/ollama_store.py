"""
Ollama's on-disk model store, read and written the way Ollama does, so that
pointing Blazar's C{ollama_models} at an existing C{~/.ollama/models} serves
what Ollama already pulled (and Ollama can serve what Blazar pulled).

Layout under the store's root::

    blobs/sha256-<hex>                              content-addressed layers
    blobs/sha256-<hex>-partial, -partial-<N>        a download in progress
    blobs/.tmp-*, manifests/.../.tmp-*              files being written (then renamed)
    manifests/<host>/<namespace>/<model>/<tag>      one JSON manifest per name

A manifest is the Docker Registry v2 image manifest
(C{application/vnd.docker.distribution.manifest.v2+json})::

    {"schemaVersion": 2, "mediaType": "...manifest.v2+json",
     "config": {"mediaType": "...", "digest": "sha256:<hex>", "size": N},
     "layers": [{"mediaType": "application/vnd.ollama.image.model",
                 "digest": "sha256:<hex>", "size": N}, ...]}

Layers are told apart by media type (L{MEDIA_MODEL}, L{MEDIA_PROJECTOR},
...): the GGUF weights, a vision projector, LoRA adapters, and small text or
JSON blobs (template, system prompt, parameters, messages, license).

Names follow Ollama's C{types/model/name.go}: C{[host/][namespace/]model[:tag]},
defaulting to C{registry.ollama.ai}, C{library} and C{latest}; shown as Ollama
shows them (L{OllamaName.display}: C{qwen3:latest}, C{ns/name:tag}, the host
only when it is not the default).

Every function here is thread-side (C{thd_*}: blocking file I/O, no Twisted
object); callers run them in the reactor's thread pool. Nothing is named
until it is whole: blobs and manifests are written to a temporary file in
the same directory, then renamed.

A delete removes the blobs no manifest names any more, so what is in
progress guards its own: a manifest write and a delete's blob cleanup take
the store's lock in turn (L{thd_store_lock}: this process's, and an
C{flock} on C{<root>/.blazar-lock} for another daemon on the same store),
and a pull or create holds the digests it relies on (L{hold}) until its
manifest is written, which the cleanup leaves alone. Temporary files a
crash left are removed at the daemon's start (L{thd_sweep_temporaries}).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import attrs

from blazar import strictjson
from blazar.files import write_whole

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

MEDIA_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_CONFIG = "application/vnd.docker.container.image.v1+json"
MEDIA_MODEL = "application/vnd.ollama.image.model"
MEDIA_PROJECTOR = "application/vnd.ollama.image.projector"
MEDIA_ADAPTER = "application/vnd.ollama.image.adapter"
MEDIA_TEMPLATE = "application/vnd.ollama.image.template"
MEDIA_SYSTEM = "application/vnd.ollama.image.system"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_LICENSE = "application/vnd.ollama.image.license"
MEDIA_MESSAGES = "application/vnd.ollama.image.messages"

#: text layers larger than this are not read into memory (Ollama's are a few KiB)
MAX_TEXT_LAYER = 4 << 20
#: manifests larger than this are not read (Ollama's are under 2 KiB)
MAX_MANIFEST = 1 << 20

_DIGEST = re.compile(r"^sha256[:\-]([0-9a-f]{64})$")
_TEMP = ".tmp-"
#: the store's lock file (under its root, where Ollama's blob pruning does not look)
LOCK_FILE = ".blazar-lock"

# guards the two tables, and a cleanup's look at the holds and rename of one
# blob; never held across other I/O (the reactor takes it to hold digests)
_GUARD = threading.Lock()
_LOCKS: dict[str, threading.Lock] = {}
_HELD: dict[str, Counter[str]] = {}


class InvalidName(ValueError):
    """
    A model name Ollama's rules do not allow; the message gives the form.
    """


class StoreError(Exception):
    """
    The store cannot do what was asked; the message says why and what to do.
    """


class DigestMismatch(StoreError):
    """
    A file's sha256 is not the digest it was offered under.

    @ivar expected: C{sha256:<hex>} it should have had.
    @ivar actual: C{sha256:<hex>} it has.
    """

    def __init__(self, expected: str, actual: str, what: str = "the blob") -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(f"{what} has sha256 {actual}, not the {expected} it was named by; it was not stored")


def _valid_part(kind: str, text: str) -> bool:
    """
    Ollama's C{isValidPart}: 1-80 characters (a host up to 350), the first
    a letter, digit or C{_}, then those or C{_ -}, C{.} except in a
    namespace, C{:} only in a host (its port).
    """
    if not 1 <= len(text) <= (350 if kind == "host" else 80):
        return False
    if not (text[0].isascii() and (text[0].isalnum() or text[0] == "_")):
        return False
    for c in text[1:]:
        if c in "_-":
            continue
        if c == ".":
            if kind == "namespace":
                return False
            continue
        if c == ":":
            if kind != "host":
                return False
            continue
        if not (c.isascii() and c.isalnum()):
            return False
    return True


@attrs.frozen
class OllamaName:
    """
    A fully qualified Ollama model name.

    @ivar host: Registry host (with C{:port} if any), C{registry.ollama.ai}
        by default: the configured C{registry}.
    @ivar namespace: C{library} by default.
    @ivar model: The model.
    @ivar tag: C{latest} by default.
    """

    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """
        The shortest form, as Ollama lists it: C{model:tag},
        C{namespace/model:tag} outside C{library}, C{host/namespace/model:tag}
        on another registry.
        """
        if self.host.casefold() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.casefold() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def full(self) -> str:
        """
        C{host/namespace/model:tag}.
        """
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def repository(self) -> str:
        """
        C{namespace/model}, the repository in registry URLs (C{/v2/<repository>/...}).
        """
        return f"{self.namespace}/{self.model}"

    @property
    def default_host(self) -> bool:
        """
        Whether the name is on the default registry (the configured C{registry}).
        """
        return self.host.casefold() == DEFAULT_HOST

    def key(self) -> tuple[str, str, str, str]:
        """
        The name case-folded, as Ollama compares names.
        """
        return (self.host.casefold(), self.namespace.casefold(), self.model.casefold(), self.tag.casefold())


def parse_name(text: str) -> OllamaName:
    """
    Parse a model name as Ollama does (C{ParseName}): C{model},
    C{model:tag}, C{namespace/model[:tag]}, C{host/namespace/model[:tag]};
    a leading C{http://} or C{https://} is dropped.

    >>> parse_name("qwen3").full
    'registry.ollama.ai/library/qwen3:latest'

    @raise InvalidName: Empty, too many parts, or characters Ollama's names
        do not allow.
    """
    if not isinstance(text, str):
        raise InvalidName(f"invalid model name {text!r}: expected a string")
    s = text.strip()
    if "@" in s:  # name@sha256:..., a digest-pinned name: not for storing
        raise InvalidName(f"invalid model name {text!r}: digest-pinned names (@sha256:...) are not supported")
    for scheme in ("https://", "http://"):
        if s.startswith(scheme):
            s = s[len(scheme) :]
    tag = DEFAULT_TAG
    if s.rfind(":") > s.rfind("/"):
        s, tag = s.rsplit(":", 1)
    parts = s.split("/")
    if len(parts) == 1:
        host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0]
    elif len(parts) == 2:
        host, namespace, model = DEFAULT_HOST, parts[0], parts[1]
    elif len(parts) == 3:
        host, namespace, model = parts
    else:
        raise InvalidName(f"invalid model name {text!r}: use [host/][namespace/]model[:tag]")
    for kind, part in (("host", host), ("namespace", namespace), ("model", model), ("tag", tag)):
        if not _valid_part(kind, part):
            raise InvalidName(
                f"invalid model name {text!r}: the {kind} {part!r} is not allowed (use [host/][namespace/]model[:tag] "
                "with letters, digits, '_', '-' and '.', up to 80 characters a part)"
            )
    return OllamaName(host, namespace, model, tag)


def digest_hex(digest: str) -> str:
    """
    The hex of C{sha256:<hex>} (or C{sha256-<hex>}).

    @raise StoreError: Not a sha256 digest.
    """
    m = _DIGEST.match(digest) if isinstance(digest, str) else None
    if m is None:
        raise StoreError(f"invalid digest {digest!r}: expected sha256:<64 lowercase hex digits>")
    return m[1]


def blob_path(root: Path, digest: str) -> Path:
    """
    Where the blob C{digest} (C{sha256:<hex>}) lives: C{<root>/blobs/sha256-<hex>}.

    @raise StoreError: Not a sha256 digest.
    """
    return root / "blobs" / f"sha256-{digest_hex(digest)}"


def partial_path(root: Path, digest: str) -> Path:
    """
    The data file of a download of C{digest} in progress:
    C{<root>/blobs/sha256-<hex>-partial} (its parts' bookkeeping is in
    C{...-partial-<N>}, as Ollama keeps it).
    """
    return root / "blobs" / f"sha256-{digest_hex(digest)}-partial"


def manifest_path(root: Path, name: OllamaName) -> Path:
    """
    C{<root>/manifests/<host>/<namespace>/<model>/<tag>} as spelled in C{name}
    (L{thd_find_manifest} finds one spelled otherwise).
    """
    return root / "manifests" / name.host / name.namespace / name.model / name.tag


def layer(media_type: str, digest: str, size: int) -> dict[str, Any]:
    """
    One descriptor of a manifest: C{{"mediaType", "digest", "size"}}.
    """
    return {"mediaType": media_type, "digest": digest, "size": size}


def make_manifest(config: dict[str, Any], layers: list[dict[str, Any]]) -> dict[str, Any]:
    """
    A v2 manifest with C{config} and C{layers} descriptors (L{layer}).
    """
    return {"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": config, "layers": layers}


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """
    The bytes a manifest is stored (and pushed) as: compact JSON, as Ollama
    writes it; its sha256 is the model's digest.
    """
    return strictjson.encode(manifest, separators=(",", ":")).encode("utf-8")


def descriptors(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """
    The manifest's config descriptor (if any) and its layers, checked.

    @raise StoreError: A descriptor without a sha256 digest or a size.
    """
    found = []
    config = manifest.get("config")
    if isinstance(config, dict) and config.get("digest"):
        found.append(config)
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        raise StoreError("manifest has no layers list")
    found.extend(layers)
    for d in found:
        if not isinstance(d, dict):
            raise StoreError("manifest has a layer that is not an object")
        digest_hex(d.get("digest", ""))
        size = d.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise StoreError(f"manifest layer {d.get('digest')} has no valid size")
    return found


def check_manifest(manifest: object) -> dict[str, Any]:
    """
    C{manifest} if it is a v2 manifest this store can hold.

    @raise StoreError: What is wrong with it.
    """
    if not isinstance(manifest, dict):
        raise StoreError("manifest is not a JSON object")
    if manifest.get("schemaVersion") != 2:
        raise StoreError(f"manifest schemaVersion is {manifest.get('schemaVersion')!r}, not 2")
    descriptors(manifest)
    return manifest


def _manifest_dirs(root: Path) -> Iterator[tuple[Path, tuple[str, str, str, str]]]:
    base = root / "manifests"
    if not base.is_dir():
        return
    for host in sorted(base.iterdir()):
        if not host.is_dir() or host.name.startswith("."):
            continue
        for namespace in sorted(host.iterdir()):
            if not namespace.is_dir() or namespace.name.startswith("."):
                continue
            for model in sorted(namespace.iterdir()):
                if not model.is_dir() or model.name.startswith("."):
                    continue
                for tag in sorted(model.iterdir()):
                    if tag.is_file() and not tag.name.startswith("."):
                        yield tag, (host.name, namespace.name, model.name, tag.name)


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST + 1)
    if len(data) > MAX_MANIFEST:
        raise StoreError(f"manifest {path} is over {MAX_MANIFEST} bytes")
    try:
        return check_manifest(json.loads(data))
    except ValueError as e:
        raise StoreError(f"manifest {path} is not JSON: {e}") from None


def thd_list(root: Path) -> list[tuple[OllamaName, dict[str, Any]]]:
    """
    Every readable manifest under C{root}, sorted by path. Manifests that
    are not valid (unreadable, not JSON, a name Ollama would not allow) are
    left out. Blocking: thread pool.
    """
    found = []
    for path, (host, namespace, model, tag) in _manifest_dirs(root):
        try:
            name = parse_name(f"{host}/{namespace}/{model}:{tag}")
            found.append((name, _read_json(path)))
        except (InvalidName, StoreError, OSError):
            continue
    return found


def thd_find_manifest(root: Path, name: OllamaName) -> Path | None:
    """
    The manifest file of C{name}, matched case-insensitively (Ollama's
    names are); L{None} if there is none.
    """
    exact = manifest_path(root, name)
    if exact.is_file():
        return exact
    wanted = name.key()
    for path, parts in _manifest_dirs(root):
        if tuple(p.casefold() for p in parts) == wanted:
            return path
    return None


def thd_read_manifest(root: Path, name: OllamaName) -> dict[str, Any]:
    """
    The manifest of C{name}. Blocking: thread pool.

    @raise FileNotFoundError: No such model in the store.
    @raise StoreError: The manifest is not a valid v2 manifest.
    """
    path = thd_find_manifest(root, name)
    if path is None:
        raise FileNotFoundError(errno.ENOENT, f"no manifest for {name.display}", str(manifest_path(root, name)))
    return _read_json(path)


def thd_manifest_digest(root: Path, name: OllamaName) -> str:
    """
    C{sha256:<hex>} of the manifest file's bytes: the model's digest, as
    Ollama's C{/api/tags} gives it. Blocking: thread pool.

    @raise FileNotFoundError: No such model in the store.
    """
    path = thd_find_manifest(root, name)
    if path is None:
        raise FileNotFoundError(errno.ENOENT, f"no manifest for {name.display}", str(manifest_path(root, name)))
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _atomic_write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    write_whole(target.with_name(f"{_TEMP}{target.name}-{secrets.token_hex(4)}"), target, lambda f: f.write(data))


def _root_key(root: Path) -> str:
    return os.path.abspath(root)


@contextmanager
def thd_store_lock(root: Path) -> Iterator[None]:
    """
    Hold the store's lock while the block runs: this process's lock for
    C{root}, then an exclusive C{flock} on C{<root>/.blazar-lock} (another
    daemon on the same store waits too; a store that cannot take the file,
    not made yet or read-only, has only this process's lock). Manifest
    writes and a delete's blob cleanup run under it. Not reentrant.
    Blocking: thread pool.
    """
    with _GUARD:
        lock = _LOCKS.setdefault(_root_key(root), threading.Lock())
    with lock:
        try:
            fd: int | None = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            fd = None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            if fd is not None:
                os.close(fd)  # (which releases the flock)


class Hold:
    """
    Blobs an operation in progress (a pull, a create) relies on, by
    digest: a delete's blob cleanup (L{thd_delete_manifest}) leaves them
    where they are until the hold is released, so the manifest the
    operation writes last finds them. Holds count (two pulls may hold one
    digest). Thread-safe, and no file I/O: the reactor makes and releases
    them. A context manager: released on exit.
    """

    def __init__(self, root: Path, digests: Iterable[str] = ()) -> None:
        self._key = _root_key(root)
        self._digests: Counter[str] = Counter()
        self.add(digests)

    def add(self, digests: Iterable[str]) -> None:
        """
        Hold C{digests} (C{sha256:<hex>}) too.
        """
        more = Counter(digests)
        with _GUARD:
            _HELD.setdefault(self._key, Counter()).update(more)
            self._digests.update(more)

    def release(self) -> None:
        """
        Let go of every digest this hold holds (again: nothing).
        """
        with _GUARD:
            held = _HELD.get(self._key)
            if held is not None:
                held -= self._digests  # (what drops to zero goes)
                if not held:
                    del _HELD[self._key]
            self._digests.clear()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def hold(root: Path, digests: Iterable[str] = ()) -> Hold:
    """
    Hold C{digests} of the store at C{root} (L{Hold}), for a C{with} block.
    """
    return Hold(root, digests)


def held_digests(root: Path) -> set[str]:
    """
    The digests held in the store at C{root} now.
    """
    with _GUARD:
        return set(_HELD.get(_root_key(root), ()))


def _write_manifest(root: Path, name: OllamaName, manifest: dict[str, Any]) -> str:
    for d in descriptors(manifest):
        if not thd_has_blob(root, d["digest"], d["size"]):
            raise StoreError(f"blob {d['digest']} ({d['size']} bytes) of {name.display} is not in the store")
    data = manifest_bytes(manifest)
    target = thd_find_manifest(root, name) or manifest_path(root, name)
    _atomic_write(target, data)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def thd_write_manifest(root: Path, name: OllamaName, manifest: dict[str, Any]) -> str:
    """
    Name C{manifest} C{name} (replacing what had that name, however it was
    spelled): written to a temporary file, then renamed, under the store's
    lock (L{thd_store_lock}: no delete removes a blob between the check
    that each is there and the rename). Blocking: thread pool.

    @return: The manifest's digest, C{sha256:<hex>}.
    @raise StoreError: Not a valid manifest, or a blob it names is not in
        the store (a model is never named before all its blobs are there).
    @raise OSError: The write failed (nothing was named).
    """
    check_manifest(manifest)
    with thd_store_lock(root):
        return _write_manifest(root, name, manifest)


def thd_copy_manifest(root: Path, source: OllamaName, destination: OllamaName) -> str:
    """
    Name C{source}'s manifest C{destination} too: a new manifest naming the
    same blobs (zero-copy, as Ollama copies), read and written under the
    store's lock. Blocking: thread pool.

    @return: The manifest's digest (the same as the source's).
    @raise FileNotFoundError: No model C{source}.
    @raise StoreError: Its manifest is not valid, or a blob is missing.
    """
    with thd_store_lock(root):
        return _write_manifest(root, destination, thd_read_manifest(root, source))


def thd_delete_manifest(root: Path, name: OllamaName) -> list[str]:
    """
    Remove the model C{name}, then those of its blobs no other manifest
    names and no pull or create in progress holds (L{hold}), under the
    store's lock (blobs no manifest named before, such as an upload
    waiting for its create, are left alone). Blocking: thread pool.

    @return: The digests of the blobs removed.
    @raise FileNotFoundError: No such model in the store.
    """
    with thd_store_lock(root):
        return _delete_manifest(root, name)


def _delete_manifest(root: Path, name: OllamaName) -> list[str]:
    path = thd_find_manifest(root, name)
    if path is None:
        raise FileNotFoundError(errno.ENOENT, f"no manifest for {name.display}", str(manifest_path(root, name)))
    try:
        mine = {d["digest"] for d in descriptors(_read_json(path))}
    except StoreError:
        mine = set()
    path.unlink()
    parent = path.parent
    base = root / "manifests"
    while parent != base and parent.is_relative_to(base):
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
        parent = parent.parent
    still = {d["digest"] for _, m in thd_list(root) for d in descriptors(m)}
    removed = []
    key = _root_key(root)
    for digest in sorted(mine - still):
        blob = blob_path(root, digest)
        doomed = blob.with_name(f"{_TEMP}deleted-{blob.name}-{secrets.token_hex(4)}")
        with _GUARD:  # (a hold taken after this look finds the blob gone, and fetches it again)
            held = _HELD.get(key)
            if held is not None and held[digest] > 0:
                continue
            try:
                os.replace(blob, doomed)  # (a rename: the unlink of a big file waits for no one)
            except FileNotFoundError:
                continue
        doomed.unlink(missing_ok=True)
        removed.append(digest)
    return removed


def thd_referenced(root: Path) -> set[str]:
    """
    The digests some manifest names. Blocking: thread pool.
    """
    return {d["digest"] for _, m in thd_list(root) for d in descriptors(m)}


def thd_has_blob(root: Path, digest: str, size: int | None = None) -> bool:
    """
    Whether the blob C{digest} is in the store (of C{size} bytes, if given).
    The file's name is trusted: blobs are named only after their sha256 was
    checked. Blocking: thread pool.
    """
    try:
        st = blob_path(root, digest).stat()
    except OSError:
        return False
    return size is None or st.st_size == size


def thd_sha256_file(path: Path) -> str:
    """
    C{sha256:<hex>} of a file. Blocking: thread pool.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def thd_copy_hashed(source: IO[bytes], target: Path) -> str:
    """
    Copy the rest of C{source} into a new file C{target}, on disk when this
    returns. Blocking: thread pool.

    @return: The sha256 digest of what was copied (C{sha256:HEX}).
    """
    h = hashlib.sha256()
    with open(target, "wb") as out:
        while chunk := source.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return "sha256:" + h.hexdigest()


def _temp_blob(root: Path, digest: str) -> Path:
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    return blobs / f"{_TEMP}sha256-{digest_hex(digest)}-{secrets.token_hex(4)}"


def thd_add_blob(root: Path, source_path: Path, digest: str) -> Path:
    """
    Copy C{source_path} into the store as the blob C{digest}: copied to a
    temporary file while hashed, renamed only if the sha256 matches. A blob
    already there is kept. Blocking: thread pool.

    @return: The blob's path.
    @raise DigestMismatch: The file's sha256 is not C{digest} (nothing stored).
    @raise OSError: Reading or writing failed (nothing stored).
    """
    target = blob_path(root, digest)
    if target.exists():
        return target
    temp = _temp_blob(root, digest)
    try:
        with open(source_path, "rb") as src:
            actual = thd_copy_hashed(src, temp)
        if actual != f"sha256:{digest_hex(digest)}":
            raise DigestMismatch(digest, actual)
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return target


def thd_add_bytes(root: Path, data: bytes) -> str:
    """
    Store C{data} (a template, a system prompt, a config) as a blob.
    Blocking: thread pool.

    @return: Its digest, C{sha256:<hex>}.
    """
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    target = blob_path(root, digest)
    if not target.exists():
        temp = _temp_blob(root, digest)
        try:
            temp.write_bytes(data)
            os.replace(temp, target)
        finally:
            temp.unlink(missing_ok=True)
    return digest


def thd_link_blob(root: Path, source_path: Path, digest: str, verify: bool = True) -> Path:
    """
    Make C{source_path} (a large file already on this machine, such as a GGUF
    in C{models_dir}) the blob C{digest} without copying it: a hard link
    (a copy only across filesystems). Blocking: thread pool.

    @param verify: Hash the file first; L{False} only when the caller has
        just hashed it.
    @return: The blob's path.
    @raise DigestMismatch: The file's sha256 is not C{digest} (nothing stored).
    @raise OSError: The link (or copy) failed.
    """
    target = blob_path(root, digest)
    if target.exists():
        return target
    if verify:
        actual = thd_sha256_file(source_path)
        if actual != f"sha256:{digest_hex(digest)}":
            raise DigestMismatch(digest, actual, str(source_path.name))
    temp = _temp_blob(root, digest)
    try:
        try:
            os.link(os.path.realpath(source_path), temp)  # a link to the file, never to a symlink
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copyfile(source_path, temp)
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return target


def thd_put_model(
    root: Path,
    name: OllamaName,
    model_path: Path,
    texts: dict[str, bytes] | None = None,
    blobs: list[tuple[str, Path]] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """
    Store a GGUF file as the model C{name}: its blob hard-linked
    (L{thd_link_blob}), the text layers and a config blob written, then the
    manifest, last. Blocking: thread pool.

    @param texts: Media type (L{MEDIA_TEMPLATE}, L{MEDIA_SYSTEM},
        L{MEDIA_PARAMS}, ...) to the layer's bytes.
    @param blobs: Further binary layers (L{MEDIA_PROJECTOR},
        L{MEDIA_ADAPTER}): media type and file, linked too.
    @param config: Fields of the config blob besides C{model_format},
        C{rootfs} and the like (C{model_family}, C{file_type}, ...).
    @return: The manifest written.
    @raise OSError: A file cannot be read or written (the model is not named).
    """
    with hold(root) as held:  # (each blob held before it is looked for)
        layers = []
        for media, path in [(MEDIA_MODEL, model_path), *(blobs or [])]:
            digest = thd_sha256_file(path)
            held.add([digest])
            thd_link_blob(root, path, digest, verify=False)
            layers.append(layer(media, digest, path.stat().st_size))
        for media, data in (texts or {}).items():
            held.add(["sha256:" + hashlib.sha256(data).hexdigest()])
            layers.append(layer(media, thd_add_bytes(root, data), len(data)))
        body = {
            "model_format": "gguf",
            "architecture": "amd64",
            "os": "linux",
            **(config or {}),
            "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in layers]},
        }
        data = strictjson.encode(body, separators=(",", ":")).encode()
        held.add(["sha256:" + hashlib.sha256(data).hexdigest()])
        manifest = make_manifest(layer(MEDIA_CONFIG, thd_add_bytes(root, data), len(data)), layers)
        thd_write_manifest(root, name, manifest)
    return manifest


@attrs.frozen
class OllamaLayers:
    """
    What a store model's manifest says beyond its weights: the text layers
    read from their blobs, and the paths of its other binary layers.

    @ivar name: The model's store name.
    @ivar digest: The manifest's C{sha256:<hex>} (the model's digest).
    @ivar size: Bytes of all its blobs (config and layers), as Ollama's
        C{/api/tags} counts a model's size.
    @ivar model: The weights' blob (C{application/vnd.ollama.image.model}).
    @ivar template: The Go template (C{.template}), if any.
    @ivar system: The system prompt (C{.system}), if any.
    @ivar parameters: The C{.params} JSON object (C{num_ctx}, C{stop},
        C{temperature}, ...); empty if none.
    @ivar messages: The C{.messages} JSON list (C{{"role", "content"}}
        objects); empty if none.
    @ivar license: The license text(s), joined by blank lines, if any.
    @ivar projector: The vision projector's blob, if any.
    @ivar adapters: The LoRA adapters' blobs, in manifest order.
    @ivar config: The config blob's JSON (C{model_format}, C{model_family},
        C{file_type}, ...); empty if unreadable.
    @ivar modified: The manifest's mtime, seconds since the epoch.
    """

    name: OllamaName
    digest: str
    size: int
    model: Path
    template: str | None = None
    system: str | None = None
    # (the JSON ones are compared, not hashed: an entry stays hashable)
    parameters: dict[str, Any] = attrs.field(factory=dict, hash=False)
    messages: list[Any] = attrs.field(factory=list, hash=False)
    license: str | None = None
    projector: Path | None = None
    adapters: tuple[Path, ...] = ()
    config: dict[str, Any] = attrs.field(factory=dict, hash=False)
    modified: float = 0.0


def _text(path: Path) -> str:
    with open(path, "rb") as f:
        data = f.read(MAX_TEXT_LAYER + 1)
    if len(data) > MAX_TEXT_LAYER:
        raise StoreError(f"text layer {path.name} is over {MAX_TEXT_LAYER} bytes")
    return data.decode("utf-8", errors="replace")


def thd_layers(root: Path, name: OllamaName, manifest: dict[str, Any], digest: str) -> OllamaLayers:
    """
    Read C{manifest}'s layers (C{digest}: the manifest's own). Blocking:
    thread pool.

    @raise StoreError: No model layer, or a layer's blob is missing or
        unreadable.
    """
    model: Path | None = None
    template = system = license_ = None
    parameters: dict[str, Any] = {}
    messages: list[Any] = []
    projector: Path | None = None
    adapters: list[Path] = []
    licenses: list[str] = []
    config: dict[str, Any] = {}
    size = 0
    try:
        for d in descriptors(manifest):
            size += d["size"]
        for d in manifest["layers"]:
            path = blob_path(root, d["digest"])
            media = d.get("mediaType")
            if media == MEDIA_MODEL:
                model = model or path
            elif media == MEDIA_PROJECTOR:
                projector = projector or path
            elif media == MEDIA_ADAPTER:
                adapters.append(path)
            elif media == MEDIA_TEMPLATE:
                template = _text(path)
            elif media == MEDIA_SYSTEM:
                system = _text(path)
            elif media == MEDIA_LICENSE:
                licenses.append(_text(path))
            elif media == MEDIA_PARAMS:
                value = json.loads(_text(path))
                parameters = value if isinstance(value, dict) else {}
            elif media == MEDIA_MESSAGES:
                value = json.loads(_text(path))
                messages = value if isinstance(value, list) else []
        cfg = manifest.get("config")
        if isinstance(cfg, dict) and cfg.get("digest"):
            try:
                value = json.loads(_text(blob_path(root, cfg["digest"])))
                config = value if isinstance(value, dict) else {}
            except (OSError, ValueError, StoreError):
                config = {}
    except OSError as e:
        raise StoreError(f"{name.display}: a layer's blob cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise StoreError(f"{name.display}: a JSON layer is not JSON ({e})") from None
    if model is None:
        raise StoreError(f"{name.display}: the manifest has no model layer ({MEDIA_MODEL})")
    license_ = "\n\n".join(licenses) if licenses else None
    return OllamaLayers(
        name, digest, size, model, template, system, parameters, messages, license_, projector, tuple(adapters), config
    )


def thd_models(root: Path) -> list[OllamaLayers]:
    """
    Every servable model in the store (a manifest whose model layer's blob
    is there), sorted by name. Blocking: thread pool.
    """
    found = []
    for path, (host, namespace, model, tag) in _manifest_dirs(root):
        try:
            name = parse_name(f"{host}/{namespace}/{model}:{tag}")
            data = path.read_bytes()
            if len(data) > MAX_MANIFEST:
                continue
            manifest = check_manifest(json.loads(data))
            layers = thd_layers(root, name, manifest, "sha256:" + hashlib.sha256(data).hexdigest())
            layers = attrs.evolve(layers, modified=path.stat().st_mtime)
        except (InvalidName, StoreError, OSError, ValueError):
            continue
        if layers.model.is_file():
            found.append(layers)
    return sorted(found, key=lambda entry: entry.name.display)


def _is_temporary(name: str) -> bool:
    """
    Whether a name in C{blobs/} is a temporary file of the store's writers:
    C{.tmp-*} (a blob copied in, an upload, a quantize's output, a blob
    being deleted), C{.*.quantizing} (llama-quantize's output), or
    C{.sha256-<hex>-partial-<N>.tmp} (a part's record, before its rename).
    """
    return (
        name.startswith(_TEMP)
        or (name.startswith(".") and name.endswith(".quantizing"))
        or (name.startswith(".sha256-") and name.endswith(".tmp"))
    )


def thd_sweep_temporaries(root: Path, before: float) -> list[Path]:
    """
    Remove the temporary files a crash or a kill left in the store: those
    of L{_is_temporary} in C{blobs/}, and C{.tmp-*} under C{manifests/},
    last modified before C{before} (seconds since the epoch: the daemon's
    start, so that nothing it writes now goes). Partial downloads stay (a
    pull resumes them). Blocking: thread pool.

    @return: The files removed.
    """
    found: list[Path] = []
    try:
        found += [Path(e.path) for e in os.scandir(root / "blobs") if _is_temporary(e.name)]
    except OSError:
        pass
    for folder, _, names in os.walk(root / "manifests"):
        found += [Path(folder) / n for n in names if n.startswith(_TEMP)]
    removed = []
    for path in found:
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_mtime >= before:
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def thd_free_bytes(root: Path) -> int:
    """
    Bytes free for the store's blobs (for the disk check before a pull).
    Blocking: thread pool.
    """
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(blobs).free
