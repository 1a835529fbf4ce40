"""
Pulling models from, and pushing them to, an Ollama-protocol registry: the
Docker Registry HTTP API v2 (the OCI distribution spec) holding
Ollama-format manifests (L{blazar.models.ollama_store}). C{registry.ollama.ai}
is one; any distribution server (Debian's C{docker-registry}, C{registry:2},
Harbor, ...) that holds such manifests is another.

Pull::

    GET /v2/<namespace>/<model>/manifests/<tag>
        Accept: application/vnd.docker.distribution.manifest.v2+json
    GET /v2/<namespace>/<model>/blobs/sha256:<hex>     (often a 307 to a CDN)
        Range: bytes=<start>-<end>

A blob is fetched in up to L{PARTS} ranged parts at once (parts of at least
L{MIN_PART} bytes), into C{<store>/blobs/sha256-<hex>-partial}, each part's
progress kept in C{...-partial-<N>} (C{{"N", "Offset", "Size", "Completed"}},
as Ollama keeps them), so a pull that stops for any reason resumes where each
part got to. A part that sends nothing for L{STALL} seconds, or breaks, is
asked again from where it stopped (up to L{RETRIES} times without progress).
Once every part is in, the file's sha256 is checked and only then renamed to
its blob name; the manifest is written last. The disk space all missing
blobs need is checked, and reserved (C{posix_fallocate}), before anything
is downloaded.

Push::

    HEAD /v2/<namespace>/<model>/blobs/<digest>     (200: there already)
    POST /v2/<namespace>/<model>/blobs/uploads/     (202, Location)
    PUT  <Location>?digest=<digest>                 (the whole blob, 201)
    PUT  /v2/<namespace>/<model>/manifests/<tag>    (the manifest, 201)

Progress objects are Ollama's (C{/api/pull} and C{/api/push} stream them):
C{{"status": "pulling manifest"}}, C{{"status": "pulling <hex12>", "digest",
"total", "completed"}}, C{verifying sha256 digest}, C{writing manifest},
C{success}; for a push C{retrieving manifest}, C{pushing <hex12>},
C{pushing manifest}, C{success}.

A registry asking for a token (C{401} with C{WWW-Authenticate: Bearer
realm=...}) gets the anonymous token flow of the distribution spec; Blazar
holds no registry credentials.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlencode, urljoin, urlsplit

import attrs
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, DeferredList, FirstError
from twisted.internet.interfaces import IConsumer
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.web.client import Agent
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from blazar import strictjson
from blazar.httpbody import read_body, relay_body
from blazar.models.hub import PullError, SerialWriter, _QuietPool
from blazar.models.ollama_store import (
    MEDIA_MANIFEST,
    DigestMismatch,
    OllamaName,
    StoreError,
    blob_path,
    check_manifest,
    descriptors,
    digest_hex,
    hold,
    partial_path,
    thd_find_manifest,
    thd_free_bytes,
    thd_has_blob,
    thd_write_manifest,
)

log = Logger()

#: parts a big blob is fetched in at once
PARTS = 4
#: no part is smaller than this (a blob under it is one part)
MIN_PART = 64 << 20
#: seconds a part may send nothing before it is asked again
STALL = 30.0
#: attempts a part may make in a row without a byte of progress
RETRIES = 6
#: bytes gathered before a write to the partial file
WRITE_BATCH = 1 << 20
#: progress lines at most this often per blob (bytes between them), besides each part's end
REPORT_EVERY = 1 << 20

Progress = Callable[[dict[str, Any]], None]
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class PushError(PullError):
    """
    A push failed; the message says why and what to do.
    """


@attrs.define
class Part:
    """
    One ranged part of a blob's download, as kept in its
    C{sha256-<hex>-partial-<n>} file.

    @ivar n: Its number, from 0.
    @ivar offset: Where it starts in the blob, bytes.
    @ivar size: Its length, bytes.
    @ivar completed: Bytes of it received (in memory: the file has them
        once the part's writes drain).
    """

    n: int
    offset: int
    size: int
    completed: int = 0

    def record(self, completed: int) -> bytes:
        """
        The part file's JSON with C{completed} bytes on disk (Ollama's shape).
        """
        return strictjson.encode(
            {"N": self.n, "Offset": self.offset, "Size": self.size, "Completed": completed}
        ).encode()


def plan_parts(total: int, parts: int = PARTS, min_part: int = MIN_PART) -> list[Part]:
    """
    Split a blob of C{total} bytes into at most C{parts} contiguous parts of
    at least C{min_part} bytes (the last takes the remainder); one part for
    a blob under C{2 * min_part}, none for an empty one.
    """
    if total <= 0:
        return []
    count = max(1, min(parts, total // max(1, min_part)))
    size = total // count
    plan = [Part(i, i * size, size) for i in range(count)]
    plan[-1].size = total - plan[-1].offset
    return plan


def _part_files(root: Path, digest: str) -> list[Path]:
    """
    The parts' records of a download: C{...-partial-<N>}, nothing else (a
    temporary file a kill left is not a part).
    """
    base = partial_path(root, digest)
    return sorted(p for p in base.parent.glob(base.name + "-*") if p.name[len(base.name) + 1 :].isdigit())


def _record_temp(record: Path) -> Path:
    """
    Where a part's record is written before it is renamed into place:
    C{.sha256-<hex>-partial-<N>.tmp}, which the parts' glob cannot match.
    """
    return record.with_name(f".{record.name}.tmp")


def thd_discard_download(root: Path, digest: str) -> None:
    """
    Remove a download's partial file, its parts' files and any temporary
    record a kill left. Blocking: thread pool.
    """
    base = partial_path(root, digest)
    for path in [*base.parent.glob(base.name + "-*"), *base.parent.glob(f".{base.name}-*.tmp")]:
        path.unlink(missing_ok=True)
    base.unlink(missing_ok=True)


def thd_partial_bytes(root: Path, digest: str, total: int) -> int:
    """
    Bytes of C{digest} already downloaded (its parts' C{Completed}), 0 if
    there is no usable partial download. Blocking: thread pool.
    """
    parts = _read_parts(root, digest, total)
    return sum(p.completed for p in parts) if parts is not None else 0


def _read_parts(root: Path, digest: str, total: int) -> list[Part] | None:
    """
    The parts a partial download of C{total} bytes recorded, if they are
    whole and consistent (contiguous, covering the blob, the data file
    there at full size).
    """
    data = partial_path(root, digest)
    try:
        if data.stat().st_size != total:
            return None
    except OSError:
        return None
    parts = []
    for path in _part_files(root, digest):
        try:
            raw = json.loads(path.read_bytes())
            part = Part(int(raw["N"]), int(raw["Offset"]), int(raw["Size"]), int(raw["Completed"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if path.name != f"{data.name}-{part.n}" or not 0 <= part.completed <= part.size:
            return None
        parts.append(part)
    parts.sort(key=lambda p: p.offset)
    at = 0
    for i, part in enumerate(parts):
        if part.n != i or part.offset != at:
            return None
        at += part.size
    return parts if parts and at == total else None


def thd_open_download(root: Path, digest: str, total: int, plan: Callable[[int], list[Part]]) -> list[Part]:
    """
    Resume the partial download of C{digest} (C{total} bytes) if one is
    there and consistent, else start one: the data file created at its
    full size, reserved on disk (C{posix_fallocate}), and C{plan(total)}'s
    parts recorded. Blocking: thread pool.

    @return: The parts, with what each has completed.
    @raise OSError: The file cannot be made or reserved (C{ENOSPC},
        C{EFBIG}: the disk is full or the file size limit too low); nothing
        is left behind then.
    """
    parts = _read_parts(root, digest, total)
    if parts is not None:
        return parts
    thd_discard_download(root, digest)
    data = partial_path(root, digest)
    data.parent.mkdir(parents=True, exist_ok=True)
    parts = plan(total)
    try:
        fd = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, total)
        finally:
            os.close(fd)
        for part in parts:
            Path(f"{data}-{part.n}").write_bytes(part.record(0))
    except BaseException:
        thd_discard_download(root, digest)
        raise
    return parts


def thd_write_part(root: Path, digest: str, part: Part, position: int, data: bytes, completed: int) -> None:
    """
    Write C{data} at C{position} of the partial file, then record that
    C{part} has C{completed} bytes on disk. Blocking: thread pool.
    """
    path = partial_path(root, digest)
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, position)
            view = view[written:]
            position += written
    finally:
        os.close(fd)
    record = Path(f"{path}-{part.n}")
    temp = _record_temp(record)
    temp.write_bytes(part.record(completed))
    os.replace(temp, record)


def thd_finish_download(root: Path, digest: str) -> Path:
    """
    Check the whole partial file's sha256 against C{digest}; if it matches,
    rename it to its blob name and drop the parts' files. Blocking: thread
    pool.

    @return: The blob's path.
    @raise DigestMismatch: It does not match; the download is discarded
        (nothing is named).
    """
    data = partial_path(root, digest)
    h = hashlib.sha256()
    with open(data, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    actual = "sha256:" + h.hexdigest()
    if actual != f"sha256:{digest_hex(digest)}":
        thd_discard_download(root, digest)
        raise DigestMismatch(digest, actual)
    target = blob_path(root, digest)
    os.replace(data, target)
    for path in _part_files(root, digest):
        path.unlink(missing_ok=True)
    return target


def _size(descriptors: list[dict[str, Any]], digest: str) -> int:
    return next(int(d["size"]) for d in descriptors if d["digest"] == digest)


def _status(verb: str, digest: str) -> str:
    return f"{verb} {digest_hex(digest)[:12]}"


def _disk_full(what: str, e: OSError, root: Path) -> PullError:
    if e.errno == errno.EFBIG:
        why = "the daemon's file size limit (ulimit -f) is lower than the blob"
    else:
        why = f"the disk holding {root} is full"
    return PullError(
        f"{what}: {why} ({e.strerror}); nothing was kept. Free space (or raise the limit), then pull again", 507
    )


@implementer(IBodyProducer)
class _FileBody:
    """
    A file as a request body, read in pieces in the thread pool (never on
    the reactor), with backpressure; C{sent(n)} is told the bytes handed
    to the transport so far.
    """

    def __init__(self, reactor: Any, path: Path, size: int, sent: Callable[[int], None]) -> None:
        self.length = size
        self._reactor = reactor
        self._path = path
        self._sent = sent
        self._paused: Deferred[None] | None = None
        self._stopped = False

    async def _run(self, consumer: IConsumer) -> None:
        offset = 0
        pool = self._reactor.getThreadPool()
        while offset < self.length and not self._stopped:
            if self._paused is not None:
                await self._paused
                continue
            chunk = await deferToThreadPool(self._reactor, pool, _read_at, self._path, offset, 1 << 20)
            if not chunk:
                raise OSError(errno.EIO, f"{self._path.name} ended at {offset} of {self.length} bytes")
            if self._stopped:
                return
            consumer.write(chunk)
            offset += len(chunk)
            self._sent(offset)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        return Deferred.fromCoroutine(self._run(consumer))

    def pauseProducing(self) -> None:
        if self._paused is None:
            self._paused = Deferred()

    def resumeProducing(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None:
            paused.callback(None)

    def stopProducing(self) -> None:
        self._stopped = True
        self.resumeProducing()


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


class _PartWriter(SerialWriter):
    """
    Writes a part's bytes to the partial file, recording its progress after
    each batch.
    """

    batch = WRITE_BATCH

    def __init__(self, reactor: Any, root: Path, digest: str, part: Part) -> None:
        super().__init__(reactor)
        self._root = root
        self._digest = digest
        self._part = part
        self._position = part.offset + part.completed  # where the pending bytes go
        self._written = part.completed

    def _job(self, data: bytes) -> Callable[[], object]:
        position = self._position
        self._position += len(data)
        self._written += len(data)
        return functools.partial(thd_write_part, self._root, self._digest, self._part, position, data, self._written)


class _Retry(Exception):
    """
    A part's request failed in a way worth asking again.
    """


async def _all(ds: list[Deferred[Any]]) -> None:
    """
    Wait for every one of C{ds}; on the first failure (or a cancel of the
    wait), cancel the others, wait until each has ended (their writes
    drained), and raise it.
    """
    if not ds:
        return
    try:
        await DeferredList(ds, fireOnOneErrback=True, consumeErrors=True)
    except BaseException as e:
        for d in ds:
            d.cancel()
        await DeferredList(ds, consumeErrors=True)
        if isinstance(e, FirstError):
            e.subFailure.raiseException()
        raise


class RegistryClient:
    """
    Pulls and pushes models of the Ollama store
    (L{blazar.models.ollama_store}) from and to Ollama-protocol registries.

    @ivar pulls: The blob downloads in progress, by digest (one at a time
        per blob, however many pulls want it).
    """

    def __init__(
        self,
        reactor: Any,
        registry: str | Callable[[], str],
        *,
        http: Any = None,
        parts: int = PARTS,
        min_part: int = MIN_PART,
        stall: float = STALL,
        retries: int = RETRIES,
    ) -> None:
        """
        @param registry: The URL names without a host (or with the default
            host, C{registry.ollama.ai}) are pulled from and pushed to, or a
            function that reads the live config's C{registry}.
        @param http: A treq C{HTTPClient} (tests: C{StubTreq}); by default
            one over this client's own connection pool.
        """
        self._reactor = reactor
        self._registry_of = registry if callable(registry) else (lambda: registry)
        self._pool: _QuietPool | None = None
        if http is None:
            self._pool = _QuietPool(reactor, persistent=True)
            http = HTTPClient(Agent(reactor, connectTimeout=30, pool=self._pool))
        self._http = http
        self._parts = parts
        self._min_part = min_part
        self._stall = stall
        self._retries = retries
        # anonymous tokens by (the registry's host, scope): never sent to another registry
        self._tokens: dict[tuple[str, str], str] = {}
        self.pulls: dict[str, Deferred[None]] = {}

    async def _thread(self, f: Callable[..., Any], *args: Any) -> Any:
        return await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), f, *args)

    # -- HTTP -------------------------------------------------------------------

    def base_url(self, name: OllamaName, insecure: bool = False) -> str:
        """
        The registry C{name} lives on: the configured C{registry} for the
        default host (or the configured one's own host), else
        C{https://<host>} (C{http://} with C{insecure}, as Ollama takes it).
        """
        configured = self._registry_of().rstrip("/")
        if name.default_host or urlsplit(configured).netloc.casefold() == name.host.casefold():
            return configured
        return f"{'http' if insecure else 'https'}://{name.host}"

    async def _request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[bytes, list[bytes]] | None = None,
        data: Any = None,
        scope: str,
        follow: bool = False,
    ) -> IResponse:
        """
        One request, with the anonymous token flow on a Bearer challenge
        (a cached token the registry refuses, expired, is dropped and the
        challenge answered once more) and, with C{follow}, redirects
        followed (without the token to another host). The caller reads or
        discards the body.

        @raise PullError: The registry is unreachable, or wants credentials.
        """
        origin = urlsplit(url).netloc
        key = (origin.casefold(), scope)
        answered = False
        for _ in range(8):
            sent = dict(headers or {})
            sent.setdefault(b"user-agent", [b"blazar"])
            on_origin = urlsplit(url).netloc == origin
            token = self._tokens.get(key) if on_origin else None
            if token is not None:
                sent[b"authorization"] = [b"Bearer " + token.encode()]
            try:
                response: IResponse = await self._http.request(
                    method, url, headers=Headers(sent), data=data, allow_redirects=False, unbuffered=True
                )
            except CancelledError:
                raise
            except Exception as e:
                raise _Retry(f"cannot reach {urlsplit(url).netloc}: {e}") from None
            if response.code == 401 and on_origin and not answered and data is None:
                answered = True
                if token is not None and self._tokens.get(key) == token:
                    del self._tokens[key]  # expired (or not enough): a new one is asked for
                challenge = (response.headers.getRawHeaders(b"www-authenticate") or [b""])[0].decode("latin-1")
                await self._discard(response)
                self._tokens[key] = await self._token(challenge, scope, url)
                continue
            if follow and response.code in (301, 302, 303, 307, 308):
                location = (response.headers.getRawHeaders(b"location") or [b""])[0].decode("latin-1")
                await self._discard(response)
                if not location:
                    raise PullError(f"{urlsplit(url).netloc} sent a redirect without a Location", 502)
                url = urljoin(url, location)
                continue
            return response
        raise PullError(f"too many redirects or challenges from {urlsplit(url).netloc}", 502)

    async def _discard(self, response: IResponse) -> None:
        try:
            await read_body(response, self._reactor, idle_timeout=30, max_bytes=1 << 16)
        except Exception:
            pass

    async def _token(self, challenge: str, scope: str, url: str) -> str:
        """
        Get an anonymous token for C{scope} from a Bearer challenge's realm.

        @return: The token.
        @raise PullError: Not a Bearer challenge, or no token given (401).
        """
        if not challenge.lower().startswith("bearer "):
            raise PullError(
                f"{urlsplit(url).netloc} wants credentials ({challenge or 'no challenge'}); Blazar "
                "pulls and pushes anonymously",
                401,
            )
        fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = fields.get("realm")
        if not realm:
            raise PullError(f"{urlsplit(url).netloc} sent a token challenge without a realm", 502)
        query = {k: v for k, v in (("service", fields.get("service")), ("scope", fields.get("scope") or scope)) if v}
        try:
            response = await self._http.request(
                "GET", f"{realm}?{urlencode(query)}", unbuffered=True, headers=Headers({b"user-agent": [b"blazar"]})
            )
            body = await read_body(response, self._reactor, idle_timeout=30, max_bytes=1 << 20)
            token = json.loads(body).get("token") or json.loads(body).get("access_token")
        except Exception as e:
            raise PullError(f"cannot get a token from {realm}: {e}", 502) from None
        if response.code != 200 or not isinstance(token, str) or not token:
            raise PullError(
                f"{urlsplit(url).netloc} refused an anonymous token ({response.code}); the "
                "repository needs credentials, which Blazar does not hold",
                401,
            )
        return token

    # -- pull -------------------------------------------------------------------

    async def pull(self, name: OllamaName, root: Path, progress: Progress, insecure: bool = False) -> list[Path]:
        """
        Pull C{name} into the store at C{root}, reporting Ollama's progress
        objects to C{progress}: the manifest, then each blob missing
        (resumed where a partial download stopped), each checked against
        its digest, then the manifest named.

        @return: The model's blobs (config and layers).
        @raise PullError: No such model (404), the registry unreachable or
            broken (502), a blob whose sha256 does not match (502, nothing
            kept of it), the disk too small (507); nothing is named then.
        """
        base = self.base_url(name, insecure)
        scope = f"repository:{name.repository}:pull"
        progress({"status": "pulling manifest"})
        manifest = await self._manifest(base, name, scope)
        config = [d for d in descriptors(manifest) if d is manifest.get("config")]
        wanted = [*manifest["layers"], *config]  # in Ollama's order: the layers, then the config
        # held before any is looked for: a delete meanwhile leaves the blobs found there for the manifest
        with hold(root, [d["digest"] for d in wanted]):
            await self._check_space(name, root, wanted)
            made = await self._reserve(name, root, wanted)
            try:
                for d in wanted:
                    await self._blob(base, name, root, d, scope, progress)
            except BaseException:
                # what this pull reserved and got no byte of goes (a part begun stays, to resume)
                for digest in made:
                    if digest not in self.pulls and not await self._thread(
                        thd_partial_bytes, root, digest, _size(wanted, digest)
                    ):
                        await self._thread(thd_discard_download, root, digest)
                raise
            progress({"status": "verifying sha256 digest"})  # (each blob was checked before it was named)
            progress({"status": "writing manifest"})
            try:
                await self._thread(thd_write_manifest, root, name, manifest)
            except StoreError as e:
                raise PullError(f"{name.display}: {e}; pull again", 502) from None
            except OSError as e:
                if e.errno in _DISK_FULL:
                    raise _disk_full(f"cannot write the manifest of {name.display}", e, root) from None
                raise PullError(f"cannot write the manifest of {name.display}: {e.strerror}", 500) from None
        progress({"status": "success"})
        return [blob_path(root, d["digest"]) for d in wanted]

    async def _manifest(self, base: str, name: OllamaName, scope: str) -> dict[str, Any]:
        url = f"{base}/v2/{name.repository}/manifests/{name.tag}"
        try:
            response = await self._request(
                "GET", url, headers={b"accept": [MEDIA_MANIFEST.encode()]}, scope=scope, follow=True
            )
            body = await read_body(response, self._reactor, idle_timeout=60, max_bytes=1 << 20)
        except _Retry as e:
            raise PullError(f"{e} (registry {base}; check registry in the config)", 502) from None
        except PullError:
            raise
        except Exception as e:
            raise PullError(f"reading the manifest of {name.display} from {base} failed: {e}", 502) from None
        if response.code == 404:
            raise PullError(f'pull model manifest: file does not exist: model "{name.display}" is not on {base}', 404)
        if response.code != 200:
            raise PullError(f"{base} answered {response.code} for the manifest of {name.display}", 502)
        try:
            return check_manifest(json.loads(body))
        except (ValueError, StoreError) as e:
            raise PullError(f"{base} sent a manifest for {name.display} that Blazar cannot use: {e}", 502) from None

    async def _check_space(self, name: OllamaName, root: Path, wanted: list[dict[str, Any]]) -> None:
        need = 0
        for d in wanted:
            if not await self._thread(thd_has_blob, root, d["digest"], d["size"]):
                # a partial download has its whole size reserved already
                exists = await self._thread(lambda p: p.exists(), partial_path(root, d["digest"]))
                need += 0 if exists else d["size"]
        try:
            free = await self._thread(thd_free_bytes, root)
        except OSError as e:
            raise PullError(f"cannot use the model store {root} (ollama_models): {e.strerror}", 500) from None
        if need > free:
            raise PullError(
                f"not enough disk space to pull {name.display}: it needs {need} more bytes and the disk holding "
                f"{root} has {free} free; nothing was downloaded",
                507,
            )

    async def _reserve(self, name: OllamaName, root: Path, wanted: list[dict[str, Any]]) -> list[str]:
        """
        Start (or find) the partial download of every blob missing, each
        file reserved at its full size, before a byte is downloaded: a disk
        that cannot hold them all fails here, and the partial files this
        step made are removed (nothing half-written).

        @return: The digests whose partial download this step started.
        @raise PullError: The disk is full, or the file size limit too low (507).
        """
        made: list[str] = []
        try:
            for d in wanted:
                digest, total = d["digest"], d["size"]
                if digest in self.pulls or await self._thread(thd_has_blob, root, digest, total):
                    continue  # (a blob another pull is fetching: that pull reserved it)
                if not await self._thread(lambda p: p.exists(), partial_path(root, digest)):
                    made.append(digest)
                await self._thread(
                    thd_open_download, root, digest, total, lambda n: plan_parts(n, self._parts, self._min_part)
                )
        except OSError as e:
            for digest in made:
                await self._thread(thd_discard_download, root, digest)
            if e.errno in _DISK_FULL:
                raise _disk_full(f"cannot pull {name.display}", e, root) from None
            raise PullError(f"cannot write to the model store {root} (ollama_models): {e.strerror}", 500) from None
        return made

    async def _blob(
        self,
        base: str,
        name: OllamaName,
        root: Path,
        d: dict[str, Any],
        scope: str,
        progress: Progress,
    ) -> None:
        digest, total = d["digest"], d["size"]
        status = _status("pulling", digest)
        while (other := self.pulls.get(digest)) is not None:  # another pull is at it: wait, then see
            try:
                await _wait(other)
            except Exception:
                pass
        # claimed before any await: a second waiter woken with this one waits for this one
        done: Deferred[None] = Deferred()
        self.pulls[digest] = done
        try:
            if await self._thread(thd_has_blob, root, digest, total):
                progress({"status": status, "digest": digest, "total": total, "completed": total})
                return
            await self._download(base, name, root, digest, total, scope, status, progress)
        finally:
            if self.pulls.get(digest) is done:
                del self.pulls[digest]
            done.callback(None)

    async def _download(
        self,
        base: str,
        name: OllamaName,
        root: Path,
        digest: str,
        total: int,
        scope: str,
        status: str,
        progress: Progress,
    ) -> None:
        try:
            parts: list[Part] = await self._thread(
                thd_open_download, root, digest, total, lambda n: plan_parts(n, self._parts, self._min_part)
            )
        except OSError as e:
            if e.errno in _DISK_FULL:
                raise _disk_full(f"cannot pull {name.display}", e, root) from None
            raise PullError(f"cannot write to the model store {root} (ollama_models): {e.strerror}", 500) from None
        reported = sum(p.completed for p in parts)

        def report(force: bool = False) -> None:
            nonlocal reported
            completed = sum(p.completed for p in parts)
            if force or completed - reported >= REPORT_EVERY:
                reported = completed
                progress({"status": status, "digest": digest, "total": total, "completed": completed})

        report(force=True)
        url = f"{base}/v2/{name.repository}/blobs/{digest}"
        try:
            await _all(
                [
                    Deferred.fromCoroutine(self._part(url, root, digest, p, scope, report))
                    for p in parts
                    if p.completed < p.size
                ]
            )
        except OSError as e:
            if e.errno in _DISK_FULL:
                await self._thread(thd_discard_download, root, digest)
                raise _disk_full(f"cannot pull {name.display}", e, root) from None
            raise PullError(f"writing {digest} of {name.display} failed: {e.strerror}; pull again", 500) from None
        try:
            await self._thread(thd_finish_download, root, digest)
        except DigestMismatch as e:
            raise PullError(
                f"{name.display}: the registry sent a blob whose sha256 is {e.actual}, not its "
                f"digest {digest}; it was refused and not kept, and no model was named",
                502,
            ) from None
        report(force=True)

    async def _part(
        self,
        url: str,
        root: Path,
        digest: str,
        part: Part,
        scope: str,
        report: Callable[[bool], None],
    ) -> None:
        failures = 0
        last = ""
        while part.completed < part.size:
            before = part.completed
            writer = _PartWriter(self._reactor, root, digest, part)
            try:
                await self._range(url, part, scope, writer, report)
            except _Retry as e:
                last = str(e)
            finally:
                await writer.drain()
            if part.completed >= part.size:
                break
            failures = 0 if part.completed > before else failures + 1
            if failures > self._retries:
                raise PullError(
                    f"downloading {digest} failed {failures} times in a row ({last or 'it ended short'}); "
                    "pull again to resume",
                    502,
                )
            log.info(
                "part {n} of {digest} stopped at {completed} of {size} bytes ({why}); asking again",
                n=part.n,
                digest=digest,
                completed=part.completed,
                size=part.size,
                why=last or "ended short",
            )
            await deferLater(self._reactor, min(0.5 * 2**failures, 8.0), lambda: None)
        report(True)

    async def _range(
        self, url: str, part: Part, scope: str, writer: _PartWriter, report: Callable[[bool], None]
    ) -> None:
        start = part.offset + part.completed
        end = part.offset + part.size - 1
        response = await self._request(
            "GET", url, headers={b"range": [f"bytes={start}-{end}".encode()]}, scope=scope, follow=True
        )
        skip = 0
        if response.code == 200:
            skip = start  # the server ignored Range: the whole blob comes; keep the part's bytes
        elif response.code != 206:
            await self._discard(response)
            if response.code == 404:
                raise PullError(f"the registry has no blob {url.rsplit('/', 1)[-1]} (404)", 404)
            if 400 <= response.code < 500 and response.code not in (408, 429):
                raise PullError(f"the registry answered {response.code} for blob {url.rsplit('/', 1)[-1]}", 502)
            raise _Retry(f"the registry answered {response.code}")
        else:
            content_range = (response.headers.getRawHeaders(b"content-range") or [b""])[0].decode("latin-1")
            m = re.match(r"bytes (\d+)-", content_range)
            if m is None or int(m[1]) != start:
                await self._discard(response)
                raise _Retry(f"the registry sent range {content_range!r} for bytes {start}-{end}")
        wanted = part.size - part.completed
        finished: Deferred[None] | None = None

        def on_chunk(data: bytes) -> None:
            nonlocal skip
            if skip:
                if len(data) <= skip:
                    skip -= len(data)
                    return
                data, skip = data[skip:], 0
            room = part.size - part.completed
            if len(data) >= room:
                data = data[:room]
            if data:
                writer.write(data)
                part.completed += len(data)
                report(False)
            if part.completed >= part.size and finished is not None:
                finished.cancel()  # (a server ignoring Range: the rest is not this part's)

        finished = relay_body(
            response,
            on_chunk,
            self._reactor,
            idle_timeout=self._stall,
            max_bytes=None if response.code == 200 else wanted,
        )
        try:
            await finished
        except CancelledError:
            if part.completed < part.size:
                raise
        except Exception as e:
            if part.completed < part.size:
                raise _Retry(f"{type(e).__name__}: {e}") from None

    # -- push -------------------------------------------------------------------

    async def push(self, name: OllamaName, root: Path, progress: Progress, insecure: bool = False) -> None:
        """
        Push the store's model C{name} to the registry its name names,
        reporting Ollama's progress objects: each blob the registry lacks
        uploaded whole (C{POST .../blobs/uploads/}, then C{PUT ...?digest=}),
        those it has skipped, then the manifest.

        @raise PushError: No such model in the store (404), the registry
            unreachable or refusing (502, 401).
        """
        base = self.base_url(name, insecure)
        scope = f"repository:{name.repository}:pull,push"
        progress({"status": "retrieving manifest"})
        path = await self._thread(thd_find_manifest, root, name)
        if path is None:
            raise PushError(f'model "{name.display}" is not in the model store; pull or create it first', 404)
        raw = await self._thread(path.read_bytes)
        try:
            manifest = check_manifest(json.loads(raw))
        except (ValueError, StoreError) as e:
            raise PushError(f"the manifest of {name.display} is not usable: {e}", 500) from None
        try:
            layers = [*manifest["layers"], *([manifest["config"]] if manifest.get("config", {}).get("digest") else [])]
            for d in layers:
                await self._upload(base, name, root, d, scope, progress)
            progress({"status": "pushing manifest"})
            url = f"{base}/v2/{name.repository}/manifests/{name.tag}"
            response = await self._request(
                "PUT", url, headers={b"content-type": [MEDIA_MANIFEST.encode()]}, data=raw, scope=scope
            )
            body = await read_body(response, self._reactor, idle_timeout=60, max_bytes=1 << 20)
        except _Retry as e:
            raise PushError(f"{e} (pushing {name.display} to {base})", 502) from None
        if response.code not in (200, 201, 202):
            raise PushError(
                f"{base} refused the manifest of {name.display} ({response.code}: "
                f"{body[:300].decode('utf-8', 'replace')})",
                502,
            )
        progress({"status": "success"})

    async def _upload(
        self,
        base: str,
        name: OllamaName,
        root: Path,
        d: dict[str, Any],
        scope: str,
        progress: Progress,
    ) -> None:
        digest, total = d["digest"], d["size"]
        status = _status("pushing", digest)
        repo = f"{base}/v2/{name.repository}"
        head = await self._request("HEAD", f"{repo}/blobs/{digest}", scope=scope, follow=True)
        await self._discard(head)
        if head.code == 200:
            progress({"status": status, "digest": digest, "total": total, "completed": total})
            return
        path = blob_path(root, digest)
        if not await self._thread(thd_has_blob, root, digest, total):
            raise PushError(f"blob {digest} of {name.display} is missing from the model store; pull it again", 500)
        progress({"status": status, "digest": digest, "total": total, "completed": 0})
        started = await self._request("POST", f"{repo}/blobs/uploads/", scope=scope, data=b"")
        body = await read_body(started, self._reactor, idle_timeout=60, max_bytes=1 << 20)
        location = (started.headers.getRawHeaders(b"location") or [b""])[0].decode("latin-1")
        if started.code not in (201, 202) or not location:
            raise PushError(
                f"{base} refused to start an upload of {digest} ({started.code}: "
                f"{body[:300].decode('utf-8', 'replace')})",
                401 if started.code == 401 else 502,
            )
        target = urljoin(f"{repo}/blobs/uploads/", location)
        target += ("&" if "?" in target else "?") + urlencode({"digest": digest})
        reported = 0

        def sent(n: int) -> None:
            nonlocal reported
            if n - reported >= REPORT_EVERY or n == total:
                reported = n
                progress({"status": status, "digest": digest, "total": total, "completed": n})

        response = await self._request(
            "PUT",
            target,
            scope=scope,
            data=_FileBody(self._reactor, path, total, sent) if total else b"",
            headers={b"content-type": [b"application/octet-stream"]},
        )
        body = await read_body(response, self._reactor, idle_timeout=120, max_bytes=1 << 20)
        if response.code not in (201, 204):
            raise PushError(
                f"{base} refused blob {digest} ({response.code}: {body[:300].decode('utf-8', 'replace')})", 502
            )
        if total == 0 or reported != total:
            progress({"status": status, "digest": digest, "total": total, "completed": total})

    async def close(self) -> None:
        """
        Drop cached connections.
        """
        if self._pool is not None:
            await self._pool.closeCachedConnections()


async def _wait(d: Deferred[None]) -> None:
    """
    Wait for C{d} without taking its result from its other waiters.
    """
    waiter: Deferred[None] = Deferred()

    def passthrough(result: object) -> object:
        waiter.callback(None)
        return result

    d.addBoth(passthrough)
    await waiter
