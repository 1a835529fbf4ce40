"""
Pulling GGUF files from a Hugging Face-compatible hub into C{models_dir},
next to the registry that then serves them (L{blazar.gateway.operations}
runs a pull for Ollama's C{/api/pull}).

Names follow Ollama's for Hugging Face models: C{hf.co/{user}/{repo}} and
C{hf.co/{user}/{repo}:{quant}}. Files are listed with the hub's
C{GET /api/models/{user}/{repo}/tree/main} (each LFS file carries its
C{lfs.oid}, the sha256) and fetched from
C{GET /{user}/{repo}/resolve/main/{path}} with C{Range} to resume.

A pull writes to C{<models_dir>/.partial/} and renames into
C{<models_dir>/hf.co/{user}/{repo}/{tag}.gguf} only after the sha256
matches, so a failed pull never leaves a half-written model in the registry;
the partial file stays for the next attempt to resume. A repository with a
vision projector (C{*mmproj*.gguf}: its F16 one, else the first) has it
pulled too, under its own name in the same folder, where the registry pairs
it with each of the repository's quants (L{blazar.models.registry.pair_projectors}).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import attrs
from treq.client import HTTPClient
from twisted.internet.defer import Deferred, succeed
from twisted.internet.threads import deferToThreadPool
from twisted.web.client import Agent, HTTPConnectionPool, RedirectAgent, _HTTP11ClientFactory
from twisted.web.http_headers import Headers

from blazar.httpbody import BodyTooLarge, read_body, relay_body

QUANT = re.compile(r"(?i)(?:^|[-_.])((?:I?Q\d(?:_[A-Z0-9]+)*)|F16|BF16|F32)$")
PREFERRED = ("Q4_K_M", "Q4_0", "Q5_K_M", "Q8_0")
WRITE_BATCH = 4 * 1024 * 1024


class PullError(Exception):
    """
    A pull failed; the message says why and what to do.

    @ivar status: HTTP status to answer with when nothing was streamed yet.
    """

    def __init__(self, message: str, status: int = 500) -> None:
        self.status = status
        super().__init__(message)


@attrs.frozen
class HubName:
    """
    A parsed C{hf.co/{user}/{repo}[:{tag}]}.
    """

    user: str
    repo: str
    tag: str

    @property
    def name(self) -> str:
        return f"hf.co/{self.user}/{self.repo}:{self.tag}"


def parse_hub_name(name: str) -> HubName:
    """
    @raise PullError: Not a Hugging Face name (400), with the accepted forms.
    """
    m = re.fullmatch(
        # each part starts with a letter, digit or "_": no "." or ".." path tricks
        r"(?:https?://)?(?:hf\.co|huggingface\.co)/([A-Za-z0-9_][A-Za-z0-9_.\-]*)/"
        r"([A-Za-z0-9_][A-Za-z0-9_.\-]*)(?::([A-Za-z0-9_][A-Za-z0-9_.\-]*))?",
        name.strip(),
    )
    if not m:
        raise PullError(
            f"cannot pull {name!r}: Blazar pulls GGUF files from Hugging Face; use "
            "hf.co/{user}/{repo} or hf.co/{user}/{repo}:{quant} (e.g. "
            "hf.co/bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M), or copy a .gguf file into models_dir",
            400,
        )
    return HubName(m[1], m[2], m[3] or "latest")


def _quant(f: dict[str, Any]) -> str:
    """
    The quant a GGUF's name ends in (C{Q4_K_M}, C{F16}, ...), upper case;
    empty if none.
    """
    stem = Path(f["path"]).name[: -len(".gguf")]
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)
    m = QUANT.search(stem)
    return m[1].upper() if m else ""


def _is_projector(f: dict[str, Any]) -> bool:
    path = str(f.get("path", ""))
    return f.get("type", "file") == "file" and path.endswith(".gguf") and "mmproj" in path.lower()


def choose_projector(files: list[dict[str, Any]]) -> dict[str, Any] | None:
    """
    The vision projector of a repo listing: its C{*mmproj*.gguf} file whose
    name ends in C{F16}, else the first; L{None} for a repository without.
    """
    projectors = [f for f in files if _is_projector(f)]
    return next((f for f in projectors if _quant(f) == "F16"), projectors[0] if projectors else None)


def choose_files(files: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """
    The GGUF file(s) for C{tag} from a repo listing: the file whose name
    ends in the quant C{tag} (case-insensitive), else for C{latest} the
    first of L{PREFERRED} present, else the only GGUF. A split model gives
    all its shards, in order.

    @raise PullError: No match (404), naming the quants there are.
    """
    ggufs = [
        f
        for f in files
        if f.get("type", "file") == "file" and str(f.get("path", "")).endswith(".gguf") and not _is_projector(f)
    ]
    wanted = tag.upper()
    match = [f for f in ggufs if _quant(f) == wanted]
    if not match and tag == "latest":
        for q in PREFERRED:
            match = [f for f in ggufs if _quant(f) == q]
            if match:
                break
        if not match and len({_quant(f) for f in ggufs}) == 1:
            match = ggufs
    if not match:
        there = sorted({_quant(f) for f in ggufs if _quant(f)})
        raise PullError(
            f"no GGUF file for tag {tag!r}; the repository has: {', '.join(there) or 'no GGUF files'}",
            404,
        )
    shards = [f for f in match if re.search(r"-\d{5}-of-\d{5}\.gguf$", f["path"])]
    if shards:
        first = sorted(shards, key=lambda f: f["path"])
        return first
    return match[:1]


def target_paths(models_dir: Path, name: HubName, files: list[dict[str, Any]]) -> list[Path]:
    """
    Where the pulled files go: C{hf.co/{user}/{repo}/{tag}.gguf}, or
    C{{tag}-0000i-of-0000N.gguf} for shards.
    """
    base = models_dir / "hf.co" / name.user / name.repo
    if len(files) == 1:
        return [base / f"{name.tag}.gguf"]
    n = len(files)
    return [base / f"{name.tag}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def thd_prepare(partial: Path) -> tuple[int, Any]:
    """
    Open C{partial} for appending and hash what it already holds.
    Blocking: thread pool.

    @return: (bytes already there, sha256 object over them)
    """
    partial.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = 0
    if partial.exists():
        with open(partial, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
    return size, h


def thd_append(partial: Path, data: bytes, h: Any) -> None:
    """
    Append C{data} and hash it. Blocking: thread pool.
    """
    with open(partial, "ab") as f:
        f.write(data)
    h.update(data)


def thd_discard(partial: Path) -> None:
    """
    Remove a partial file, if there. Blocking: thread pool.
    """
    partial.unlink(missing_ok=True)


def thd_size(path: Path) -> int | None:
    """
    A file's size, L{None} if it is not there. Blocking: thread pool.
    """
    try:
        return path.stat().st_size
    except OSError:
        return None


def thd_install(partials: list[Path], targets: list[Path]) -> None:
    """
    Move verified partial files into place. Blocking: thread pool.
    """
    for partial, target in zip(partials, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, target)


class SerialWriter(ABC):
    """
    Writes downloaded bytes in the thread pool, in order, in batches of
    L{batch} bytes (the rest at L{drain}); a subclass says what writing a
    batch is (L{_job}).
    """

    batch = WRITE_BATCH

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor
        self._pending = bytearray()
        self._tail: Deferred[Any] = succeed(None)

    @abstractmethod
    def _job(self, data: bytes) -> Callable[[], object]:
        """
        The thread-side work that writes the batch C{data}; asked on the
        reactor thread, batch after batch, in order.
        """

    def _submit(self) -> None:
        data = bytes(self._pending)
        self._pending.clear()
        job = self._job(data)

        def go(_: object) -> Deferred[object]:
            return deferToThreadPool(self._reactor, self._reactor.getThreadPool(), job)

        self._tail.addCallback(go)

    def write(self, data: bytes) -> None:
        self._pending.extend(data)
        if len(self._pending) >= self.batch:
            self._submit()

    async def drain(self) -> None:
        """
        Wait until everything written so far is on disk.

        @raise OSError: A write failed.
        """
        if self._pending:
            self._submit()
        tail, self._tail = self._tail, succeed(None)
        await tail


class _HashingWriter(SerialWriter):
    """
    Appends downloaded bytes to a partial file, hashing as it goes.
    """

    def __init__(self, reactor: Any, partial: Path, h: Any) -> None:
        super().__init__(reactor)
        self._partial = partial
        self._h = h

    def _job(self, data: bytes) -> Callable[[], object]:
        return functools.partial(thd_append, self._partial, data, self._h)


class _QuietPool(HTTPConnectionPool):
    """
    A connection pool that does not log "Starting factory" / "Stopping
    factory" for every connection to the hub.
    """

    class _factory(_HTTP11ClientFactory):
        noisy = False


class HubClient:
    """
    Lists and downloads files from a Hugging Face-compatible endpoint.
    """

    def __init__(self, reactor: Any, endpoint: str | Callable[[], str], token: str | None = None) -> None:
        """
        @param endpoint: The hub's base URL, or a function that reads the
            live config's C{hf_endpoint} (so a reload applies to the next
            request).
        """
        self._reactor = reactor
        self._endpoint_of = endpoint if callable(endpoint) else (lambda: endpoint)
        self._pool = _QuietPool(reactor, persistent=True)
        self._http = HTTPClient(RedirectAgent(Agent(reactor, connectTimeout=30, pool=self._pool)))
        self._token = token

    @property
    def _endpoint(self) -> str:
        return self._endpoint_of().rstrip("/")

    def _headers(self, extra: dict[bytes, list[bytes]] | None = None) -> Headers:
        h: dict[bytes, list[bytes]] = {b"user-agent": [b"blazar"]}
        if self._token:
            h[b"authorization"] = [b"Bearer " + self._token.encode()]
        h.update(extra or {})
        return Headers(h)

    async def _thread(self, f: Callable[..., Any], *args: Any) -> Any:
        return await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), f, *args)

    async def list_files(self, name: HubName) -> list[dict[str, Any]]:
        """
        The repository's files (recursive listing of C{main}).

        @raise PullError: The hub is unreachable or has no such repository.
        """
        url = f"{self._endpoint}/api/models/{name.user}/{name.repo}/tree/main?recursive=true"
        try:
            response = await self._http.get(url, headers=self._headers(), unbuffered=True)
            body = await read_body(response, self._reactor, idle_timeout=60, max_bytes=16 << 20)
        except Exception as e:
            raise PullError(f"cannot reach {self._endpoint} (hf_endpoint in the config): {e}", 502) from None
        if response.code == 404 or response.code == 401:
            raise PullError(f"repository {name.user}/{name.repo} not found on {self._endpoint}", 404)
        if response.code != 200:
            raise PullError(f"{self._endpoint} answered {response.code} listing {name.user}/{name.repo}", 502)
        try:
            files = json.loads(body)
        except ValueError:
            raise PullError(f"{self._endpoint} sent an unreadable file listing", 502) from None
        if not isinstance(files, list):
            raise PullError(f"{self._endpoint} sent an unreadable file listing", 502)
        return files

    async def pull(self, name: HubName, models_dir: Path, progress: Callable[[dict[str, Any]], None]) -> list[Path]:
        """
        Download C{name} into C{models_dir}, and the repository's vision
        projector (L{choose_projector}) beside it unless it is there
        already (of the listed size), reporting Ollama-style progress
        objects (C{status}, C{digest}, C{total}, C{completed}) for each file.

        @return: The installed files (the projector last).
        @raise PullError: Any failure; nothing is installed then.
        """
        progress({"status": "pulling manifest"})
        listing = await self.list_files(name)
        files = choose_files(listing, name.tag)
        targets = target_paths(models_dir, name, files)
        projector = choose_projector(listing)
        if projector is not None:
            files.append(projector)
            targets.append(targets[0].parent / Path(projector["path"]).name)
        partial_dir = models_dir / ".partial"
        partials, installs = [], []
        for f, target in zip(files, targets):
            sha = (f.get("lfs") or {}).get("oid") or (f.get("lfs") or {}).get("sha256")
            total = int((f.get("lfs") or {}).get("size") or f.get("size") or 0)
            if not sha:
                raise PullError(f"{f['path']} has no sha256 in the hub's listing; cannot verify it", 502)
            if f is projector and total and await self._thread(thd_size, target) == total:
                # (pulled with another quant: one projector serves them all)
                progress(
                    {"status": f"pulling {sha[:12]}", "digest": f"sha256:{sha}", "total": total, "completed": total}
                )
                continue
            partial = partial_dir / f"{name.user}--{name.repo}--{target.name}.partial"
            partials.append(partial)
            installs.append(target)
            await self._download(name, f["path"], partial, sha, total, progress)
        progress({"status": "verifying sha256 digest"})
        progress({"status": "writing manifest"})
        await self._thread(thd_install, partials, installs)
        progress({"status": "success"})
        return targets

    async def _download(
        self,
        name: HubName,
        path: str,
        partial: Path,
        sha: str,
        total: int,
        progress: Callable[[dict[str, Any]], None],
    ) -> None:
        digest = f"sha256:{sha}"
        have, h = await self._thread(thd_prepare, partial)
        if total and have > total:
            await self._thread(partial.unlink)
            have, h = await self._thread(thd_prepare, partial)
        status = f"pulling {sha[:12]}"
        progress({"status": status, "digest": digest, "total": total, "completed": have})
        if not total or have < total:
            url = f"{self._endpoint}/{name.user}/{name.repo}/resolve/main/{path}"
            extra = {b"range": [f"bytes={have}-".encode()]} if have else {}
            try:
                response = await self._http.get(url, headers=self._headers(extra), unbuffered=True)
            except Exception as e:
                raise PullError(f"cannot download {path}: {e}", 502) from None
            if response.code == 200 and have:
                # the server ignored Range: start over
                await self._thread(partial.unlink)
                have, h = await self._thread(thd_prepare, partial)
            elif response.code not in (200, 206):
                raise PullError(f"downloading {path}: the hub answered {response.code}", 502)
            completed = have
            writer = _HashingWriter(self._reactor, partial, h)
            reported = have

            def on_chunk(data: bytes) -> None:
                nonlocal completed, reported
                writer.write(data)
                completed += len(data)
                if completed - reported >= (1 << 20):
                    reported = completed
                    progress({"status": status, "digest": digest, "total": total, "completed": completed})

            try:
                # no more than the listing's size: a hub that sends more is not filling the disk
                await relay_body(
                    response, on_chunk, self._reactor, idle_timeout=120, max_bytes=total - have if total else None
                )
            except BodyTooLarge:
                await writer.drain()
                await self._thread(thd_discard, partial)
                raise PullError(
                    f"{self._endpoint} sent more of {path} than the {total} bytes its listing gives; the "
                    "download was stopped and its partial file removed. Check hf_endpoint in the config, "
                    "then pull again",
                    502,
                ) from None
            except Exception as e:
                await writer.drain()
                raise PullError(
                    f"download of {path} broke after {completed} of {total} bytes ({e}); pull again to resume",
                    502,
                ) from None
            await writer.drain()
            if total and completed < total:
                raise PullError(
                    f"download of {path} ended after {completed} of the {total} bytes the hub's listing "
                    "gives; pull again to resume",
                    502,
                )
        if h.hexdigest() != sha:
            await self._thread(partial.unlink)
            raise PullError(
                f"{path}: sha256 mismatch (got {h.hexdigest()}, expected {sha}); the partial file "
                "was removed, pull again",
                502,
            )
        progress({"status": status, "digest": digest, "total": total, "completed": total or have})

    async def close(self) -> None:
        """
        Drop cached connections.
        """
        await self._pool.closeCachedConnections()
