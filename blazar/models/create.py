"""
Making a model of the Ollama store (L{blazar.models.ollama_store}) the way
Ollama's C{/api/create} does (C{server/create.go}): from an existing model
(C{from}) or from blobs uploaded first (C{files}, C{adapters}), with a
template, a system prompt, parameters, messages and licenses as text
layers, optionally quantized, and named by a manifest written last.

Progress is reported as Ollama's status lines, in its order:
C{parsing GGUF} (per file), C{quantizing F16 model to Q8_0} (with
C{digest}, C{total} and C{completed} in bytes), C{verifying conversion},
C{using existing layer sha256:<hex>} / C{creating new layer sha256:<hex>}
(per layer of the new manifest), C{writing manifest}; the caller adds
C{success}.

Nothing is copied that is already on this machine: a C{models_dir} GGUF
named by C{from} becomes a blob by a hard link (L{thd_link_blob}), a store
model's blobs are named again by the new manifest. Nothing is named before
it is whole: blobs are hashed before they are named, the manifest goes last.

Uploads (C{POST /api/blobs/sha256:<hex>}) are hashed off the reactor and
named only when the sha256 matches (L{thd_store_upload}).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import IO, Any, Callable, Mapping

import attrs
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from blazar.models.gguf_meta import GGUFError, thd_read_metadata
from blazar.models.modelfile import go_json
from blazar.models.ollama_store import (
    MEDIA_ADAPTER,
    MEDIA_CONFIG,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    DigestMismatch,
    Hold,
    OllamaName,
    StoreError,
    blob_path,
    digest_hex,
    hold,
    layer,
    make_manifest,
    thd_add_bytes,
    thd_copy_hashed,
    thd_has_blob,
    thd_link_blob,
    thd_read_manifest,
    thd_sha256_file,
    thd_write_manifest,
)
from blazar.models.quantize import QuantizeError, quantize
from blazar.models.registry import ModelEntry, ModelNotFound, ModelRegistry
from blazar.names import name_key

log = Logger()

Progress = Callable[[dict[str, Any]], None]

UNQUANTIZED = ("F32", "F16", "BF16")
QUANTIZE_DIGEST = "0000000000000000000"  # what Ollama's quantizing lines carry as their digest
_UPLOAD_PREFIX = ".tmp-upload-"


class CreateError(Exception):
    """
    A model cannot be created; the message says why and what to do.

    @ivar status: The HTTP status a front end that has answered nothing
        yet may use (400: the request is at fault; 404: a blob or model it
        names is missing; 500: the machine failed).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen
class CreateSpec:
    """
    A create request, decoded (L{blazar.web.translate.create}).

    @ivar name: The new model's name.
    @ivar source: C{from}: a model's name, or L{None}.
    @ivar files: C{files}: a file name to the digest of a blob uploaded
        first (C{sha256:<hex>}).
    @ivar adapters: C{adapters}, likewise: LoRA adapter GGUFs.
    @ivar template: The Go template to record (never applied: the GGUF's
        own chat template is what llama-server uses), or L{None}.
    @ivar system: The system prompt, or L{None} (the source's is kept).
    @ivar parameters: Checked parameters (L{blazar.models.modelfile.check_parameters});
        they override the source's, which are kept otherwise.
    @ivar messages: C{{"role", "content"}} messages, or L{None} (the
        source's are kept).
    @ivar license: License texts, added to the source's.
    @ivar quantize: llama-quantize's name of the type to quantize to
        (L{quant_type}: C{Q4_K_M}, C{Q8_0}, ...), or L{None}.
    @ivar asked_quantize: The type as the client spelled it, upper-cased
        (Ollama's status line names it so).
    """

    name: OllamaName
    source: str | None = None
    files: Mapping[str, str] = attrs.field(factory=dict)
    adapters: Mapping[str, str] = attrs.field(factory=dict)
    template: str | None = None
    system: str | None = None
    parameters: Mapping[str, Any] = attrs.field(factory=dict)
    messages: tuple[Mapping[str, str], ...] | None = None
    license: tuple[str, ...] = ()
    quantize: str | None = None
    asked_quantize: str | None = None


@attrs.frozen
class Layer:
    """
    One layer of the manifest being made.

    @ivar status: Ollama's line for it (C{using existing layer ...},
        C{creating new layer ...}).
    @ivar path: Its blob, for the binary layers.
    """

    media: str
    digest: str
    size: int
    status: str
    path: Path | None = None

    def descriptor(self) -> dict[str, Any]:
        return layer(self.media, self.digest, self.size)


# -- thread-side ---------------------------------------------------------------


def thd_gguf_kind(path: Path) -> str:
    """
    What a GGUF file is, as Ollama's create decides a layer's media type:
    L{MEDIA_ADAPTER} (C{general.type} C{adapter}), L{MEDIA_PROJECTOR}
    (C{general.type} C{projector} or C{mmproj}, or a C{clip} architecture),
    else L{MEDIA_MODEL}. Blocking: reads the header.

    @raise CreateError: Not a GGUF file (C{supplied file was not in GGUF
        format}, as Ollama says), or unreadable.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CreateError(f"cannot read blob {path.name}: {e.strerror}", 500) from None
    if magic != b"GGUF":
        raise CreateError(
            "supplied file was not in GGUF format (Blazar creates models from GGUF files only; "
            "convert safetensors with llama.cpp's convert_hf_to_gguf.py first)"
        )
    try:
        from gguf import GGUFReader

        reader = GGUFReader(os.fspath(path))
        fields = {
            name: reader.fields[name].contents()
            for name in ("general.type", "general.architecture")
            if name in reader.fields
        }
    except Exception as e:  # gguf raises ValueError and friends on a broken file
        raise CreateError(f"supplied file is not a readable GGUF file ({type(e).__name__}: {e})") from None
    kind = fields.get("general.type")
    if kind == "adapter":
        return MEDIA_ADAPTER
    if kind in ("projector", "mmproj") or fields.get("general.architecture") == "clip":
        return MEDIA_PROJECTOR
    return MEDIA_MODEL


def thd_model_facts(path: Path) -> dict[str, Any]:
    """
    The config blob's facts of a model GGUF (C{model_family},
    C{model_families}, C{model_type}, C{file_type}), as Ollama's create
    writes them. Blocking: reads the header.

    @raise CreateError: Not a readable GGUF model.
    """
    try:
        meta = thd_read_metadata(path)
    except GGUFError as e:
        raise CreateError(f"the model's GGUF {e.reason}; {e.hint}") from None
    return {
        "model_family": meta.architecture,
        "model_families": [meta.architecture],
        "model_type": meta.parameter_size,
        "file_type": meta.quantization_level,
    }


def thd_adopt(root: Path, path: Path, held: Hold | None = None) -> tuple[str, bool]:
    """
    Make a file written under C{<root>/blobs} (a quantize's output) a blob:
    hashed, then linked to its name, its temporary name removed. Blocking.

    @param held: Holds the digest before the blob is looked for.
    @return: Its digest, and whether the blob is new.
    """
    try:
        digest = thd_sha256_file(path)
        if held is not None:
            held.add([digest])
        new = not thd_has_blob(root, digest)
        thd_link_blob(root, path, digest, verify=False)
        return digest, new
    finally:
        path.unlink(missing_ok=True)


def thd_text_layer(root: Path, media: str, data: bytes, held: Hold | None = None) -> Layer:
    """
    A text layer (template, system, params, messages, license) stored as a
    blob, with Ollama's status for it. Blocking.

    @param held: Holds the digest before the blob is looked for.
    """
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if held is not None:
        held.add([digest])
    existed = thd_has_blob(root, digest)
    thd_add_bytes(root, data)
    return Layer(media, digest, len(data), f"{'using existing' if existed else 'creating new'} layer {digest}")


def upload_spool(root: Path) -> IO[bytes] | None:
    """
    A file for an upload's body in the store's C{blobs} directory (so that
    naming it a blob is a link, not a copy), removed when closed; L{None}
    if the directory cannot be written (the caller spools elsewhere).
    Blocking (creates a file): the web server calls it as a request's
    headers arrive, as it makes its own temporary files.
    """
    import tempfile

    try:
        blobs = root / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        return tempfile.NamedTemporaryFile(dir=blobs, prefix=_UPLOAD_PREFIX)  # noqa: SIM115 (closed by its owner)
    except OSError:
        return None


def thd_store_upload(root: Path, upload: IO[bytes], digest: str) -> bool:
    """
    Make an uploaded body the blob C{digest}, if its sha256 is C{digest}.
    A body spooled into the store (L{upload_spool}) is hashed and linked;
    any other is copied in while hashed. Blocking: thread pool.

    @return: Whether the blob is new (L{False}: it was there already).
    @raise DigestMismatch: The body's sha256 is another (nothing named).
    @raise StoreError: Not a sha256 digest.
    """
    target = blob_path(root, digest)
    if target.exists():
        return False
    expected = f"sha256:{digest_hex(digest)}"
    upload.flush()
    name = getattr(upload, "name", None)
    if isinstance(name, str) and Path(name).parent == root / "blobs" and Path(name).name.startswith(_UPLOAD_PREFIX):
        actual = thd_sha256_file(Path(name))
        if actual != expected:
            raise DigestMismatch(expected, actual, "the upload")
        thd_link_blob(root, Path(name), expected, verify=False)
        return True
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    temp = blobs / f"{_UPLOAD_PREFIX}{secrets.token_hex(6)}"
    try:
        upload.seek(0)
        actual = thd_copy_hashed(upload, temp)
        if actual != expected:
            raise DigestMismatch(expected, actual, "the upload")
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return True


def valid_file_name(name: str) -> bool:
    """
    Go's C{fs.ValidPath}, as Ollama checks C{files}' names: relative,
    C{/}-separated, no empty, C{.} or C{..} element.
    """
    if name == ".":
        return True
    return bool(name) and all(part not in ("", ".", "..") for part in name.split("/"))


# -- the creator ---------------------------------------------------------------


@attrs.define
class ModelCreator:
    """
    Creates store models (see the module docstring).

    @ivar _registry: Resolves C{from}, gives the store's root and
        C{models_dir} digests, and is told to rescan after a create.
    @ivar _reactor: Spawns llama-quantize and runs the file work in its
        thread pool.
    @ivar _quantizer: Finds llama-quantize (blocking: called in a thread;
        raises L{QuantizeError} with the fix when there is none).
    """

    _registry: ModelRegistry
    _reactor: Any
    _quantizer: Callable[[], Path]

    async def _in_thread(self, f: Callable[..., Any], *args: Any) -> Any:
        return await deferToThreadPool(self._reactor, self._reactor.getThreadPool(), f, *args)

    @property
    def root(self) -> Path:
        return self._registry.ollama_models

    async def has_blob(self, digest: str) -> bool:
        """
        Whether the store holds blob C{digest} (C{HEAD /api/blobs/...}).

        @raise StoreError: Not a sha256 digest.
        """
        digest_hex(digest)
        return bool(await self._in_thread(thd_has_blob, self.root, digest))

    async def store_upload(self, digest: str, upload: IO[bytes]) -> bool:
        """
        Name an uploaded body the blob C{digest} (L{thd_store_upload}).

        @return: Whether it is new.
        @raise DigestMismatch: Its sha256 is another.
        """
        return bool(await self._in_thread(thd_store_upload, self.root, upload, digest))

    async def create(self, spec: CreateSpec, progress: Progress) -> str:
        """
        Create the model C{spec.name}, reporting Ollama's status lines to
        C{progress} (all but the last, C{success}).

        @return: Its name, as the registry lists it.
        @raise CreateError: The request cannot be done, or the machine
            failed; nothing is named then.
        @raise ModelNotFound: C{from} names no model.
        """
        display = spec.name.display
        await self._check_name(display)
        # each blob it uses is held from when it is known until its manifest is written: a delete
        # meanwhile leaves them (blazar.models.ollama_store.hold)
        with hold(self.root, [*spec.files.values(), *spec.adapters.values()]) as held:
            if spec.source is not None:
                base, parameters, config = await self._from(spec.source)
            elif spec.files:
                base, parameters, config = await self._files(spec.files, MEDIA_MODEL, progress), {}, {}
            else:
                raise CreateError("neither 'from' or 'files' was specified")
            if spec.adapters:
                base += await self._files(spec.adapters, MEDIA_ADAPTER, progress)
            held.add(entry.digest for entry in base)
            models = [entry for entry in base if entry.media == MEDIA_MODEL]
            if not models:
                raise CreateError("no model layer: files must hold a GGUF model (not only adapters or projectors)")
            if len(models) > 1:
                raise CreateError(
                    "more than one model GGUF: Blazar serves one file per model; merge a split model "
                    "first (llama-gguf-split --merge)"
                )
            model = models[0]
            assert model.path is not None
            facts = await self._in_thread(thd_model_facts, model.path)
            if spec.quantize is not None:
                quantized = await self._quantize(model, facts["file_type"], spec, progress, held)
                if quantized is not model:
                    base[base.index(model)] = model = quantized
                    assert model.path is not None
                    facts = await self._in_thread(thd_model_facts, model.path)
            layers = await self._text_layers(base, spec, parameters, held)
            body = {
                **{k: v for k, v in config.items() if k in ("renderer", "parser", "requires")},
                "model_format": "gguf",
                **facts,
                "architecture": "amd64",
                "os": "linux",
                "rootfs": {"type": "layers", "diff_ids": [entry.digest for entry in layers]},
            }
            config_layer = await self._in_thread(
                thd_text_layer, self.root, MEDIA_CONFIG, go_json(body, sort_keys=False), held
            )
            for entry in layers:
                progress({"status": entry.status})
            progress({"status": "writing manifest"})
            manifest = make_manifest(config_layer.descriptor(), [entry.descriptor() for entry in layers])
            try:
                await self._in_thread(thd_write_manifest, self.root, spec.name, manifest)
            except (OSError, StoreError) as e:
                raise CreateError(f"cannot write the manifest of {display}: {e}", 500) from None
            finally:
                self._registry.forget()
        log.info("created {model} ({layers} layers)", model=display, layers=len(layers))
        return display

    async def _check_name(self, display: str) -> None:
        """
        A name a C{models_dir} file (or a remote) has is not the store's to
        take: the file would hide the new model.
        """
        try:
            wanted = name_key(display)
        except ValueError as e:
            raise CreateError(f"invalid model name: {e}") from None
        for entry in await self._registry.refresh():
            try:
                key = name_key(entry.name)
            except ValueError:
                continue
            if key == wanted and entry.ollama is None:
                where = "a remote's model" if entry.remote is not None else "a file in models_dir (or the config)"
                raise CreateError(f'model "{display}" is {where}; pick another name, or delete that model first')

    async def _from(self, source: str) -> tuple[list[Layer], dict[str, Any], dict[str, Any]]:
        """
        The layers of the model C{source}: a store model's (its manifest's),
        or a C{models_dir} GGUF (and its projector and adapters) linked
        into the store as blobs.

        @return: The layers, the source's parameters, its config.
        """
        try:
            entry = await self._registry.resolve(source)
        except ModelNotFound:
            raise CreateError(
                f'model "{source}" not found: "from" names a model Blazar serves (GET /api/tags); pull it first', 404
            ) from None
        if entry.remote is not None:
            raise CreateError(
                f'model "{entry.name}" is a remote\'s model ([[remotes]]): it has no file here to create from'
            )
        if entry.ollama is not None:
            return await self._store_layers(entry)
        if entry.format != "gguf":
            raise CreateError(f'model "{entry.name}" is a {entry.format} model directory; create from GGUF models only')
        if entry.shards:
            raise CreateError(
                f'model "{entry.name}" is split into {len(entry.shards) + 1} files; Blazar creates from '
                "one-file models: merge it first (llama-gguf-split --merge)"
            )
        try:
            digest = await self._registry.digest(entry)
        except GGUFError as e:
            raise CreateError(str(e), 500) from None
        layers = [await self._link(entry.path, MEDIA_MODEL, digest)]
        if entry.projector is not None:
            layers.append(await self._link(entry.projector, MEDIA_PROJECTOR))
        for path, _scale in entry.adapters:  # (the store keeps no scale: each is used at 1.0)
            layers.append(await self._link(path, MEDIA_ADAPTER))
        return layers, {}, {}

    async def _store_layers(self, entry: ModelEntry) -> tuple[list[Layer], dict[str, Any], dict[str, Any]]:
        assert entry.ollama is not None
        try:
            manifest = await self._in_thread(thd_read_manifest, self.root, entry.ollama.name)
        except (OSError, StoreError) as e:
            raise CreateError(f'cannot read the manifest of "{entry.name}": {e}', 500) from None
        layers = []
        for d in manifest["layers"]:
            media = d.get("mediaType", "")
            path = blob_path(self.root, d["digest"]) if media in (MEDIA_MODEL, MEDIA_PROJECTOR, MEDIA_ADAPTER) else None
            layers.append(Layer(media, d["digest"], d["size"], f"using existing layer {d['digest']}", path))
        return layers, dict(entry.ollama.parameters), dict(entry.ollama.config)

    async def _link(self, path: Path, media: str, digest: str | None = None) -> Layer:
        """
        A file on this machine as a blob: a hard link (L{thd_link_blob}).
        """
        try:
            if digest is None:
                digest = await self._in_thread(thd_sha256_file, path)
            assert digest is not None
            await self._in_thread(thd_link_blob, self.root, path, digest, False)
            size = (await self._in_thread(os.stat, path)).st_size
        except OSError as e:
            raise CreateError(f"cannot put {path.name} into the model store: {e.strerror}", 500) from None
        return Layer(media, digest, size, f"using existing layer {digest}", blob_path(self.root, digest))

    async def _files(self, files: Mapping[str, str], media: str, progress: Progress) -> list[Layer]:
        """
        Uploaded blobs as layers, each read as Ollama reads it (C{parsing
        GGUF}): a model, a projector or an adapter by its header. Adapters
        (C{media} L{MEDIA_ADAPTER}) must be adapters.
        """
        layers = []
        for name in sorted(files):
            digest = files[name]
            if name.endswith(".safetensors"):
                raise CreateError(
                    "Blazar creates models from GGUF files only; convert safetensors with llama.cpp's "
                    "convert_hf_to_gguf.py (and convert_lora_to_gguf.py for adapters) first"
                )
            path = blob_path(self.root, digest)
            if not await self._in_thread(thd_has_blob, self.root, digest):
                raise CreateError(
                    f"blob {digest} ({name}) is not on this server: upload it first (POST /api/blobs/{digest})", 404
                )
            progress({"status": "parsing GGUF"})
            kind = await self._in_thread(thd_gguf_kind, path)
            if media == MEDIA_ADAPTER and kind != MEDIA_ADAPTER:
                raise CreateError(
                    f'adapter {name} is not a LoRA adapter GGUF (its general.type is not "adapter"; '
                    "convert_lora_to_gguf.py writes them)"
                )
            size = (await self._in_thread(os.stat, path)).st_size
            layers.append(Layer(kind, digest, size, f"using existing layer {digest}", path))
        return layers

    async def _quantize(self, model: Layer, file_type: str, spec: CreateSpec, progress: Progress, held: Hold) -> Layer:
        """
        The model layer quantized to C{spec.quantize} with llama-quantize,
        its progress as Ollama's C{quantizing F16 model to Q8_0} lines; the
        new blob's digest held in C{held}.
        """
        assert spec.quantize is not None and model.path is not None
        if file_type not in UNQUANTIZED:
            raise CreateError("quantization is only supported for F16, BF16 and F32 models")
        if file_type == spec.quantize:
            return model
        try:
            binary = await self._in_thread(self._quantizer)
        except QuantizeError as e:
            raise CreateError(str(e), 500) from None
        status = f"quantizing {file_type} model to {spec.asked_quantize or spec.quantize}"
        size = model.size
        progress({"status": status, "digest": QUANTIZE_DIGEST, "total": size, "completed": 0})

        def tensors(done: int, total: int) -> None:
            progress(
                {
                    "status": status,
                    "digest": QUANTIZE_DIGEST,
                    "total": size,
                    "completed": int(size * done / total) if total else 0,
                }
            )

        temporary = self.root / "blobs" / f".tmp-quantize-{secrets.token_hex(6)}.gguf"
        try:
            await quantize(self._reactor, binary, model.path, temporary, spec.quantize, tensors)
        except QuantizeError as e:
            raise CreateError(str(e), 500) from None
        progress({"status": "verifying conversion"})
        try:
            digest, new = await self._in_thread(thd_adopt, self.root, temporary, held)
            size = (await self._in_thread(os.stat, blob_path(self.root, digest))).st_size
        except OSError as e:
            raise CreateError(f"cannot store the quantized model: {e.strerror}", 500) from None
        return Layer(
            MEDIA_MODEL,
            digest,
            size,
            f"{'creating new' if new else 'using existing'} layer {digest}",
            blob_path(self.root, digest),
        )

    async def _text_layers(
        self, base: list[Layer], spec: CreateSpec, parameters: dict[str, Any], held: Hold
    ) -> list[Layer]:
        """
        C{base} with the request's text layers, as Ollama's C{createModel}
        sets them: a template, system prompt or messages replace the
        source's; licenses are added; parameters are merged over the
        source's (a request's value wins) into one params layer. Their
        digests are held in C{held}.
        """
        layers = list(base)

        async def put(media: str, data: bytes, replace: bool = True) -> None:
            nonlocal layers
            if replace:
                layers = [entry for entry in layers if entry.media != media]
            layers.append(await self._in_thread(thd_text_layer, self.root, media, data, held))

        if spec.template:
            await put(MEDIA_TEMPLATE, spec.template.encode("utf-8"))
        if spec.system:
            await put(MEDIA_SYSTEM, spec.system.encode("utf-8"))
        for text in spec.license:
            if text:
                await put(MEDIA_LICENSE, text.encode("utf-8"), replace=False)
        merged = {**parameters, **spec.parameters}
        if merged:
            await put(MEDIA_PARAMS, go_json(merged))
        if spec.messages:
            await put(
                MEDIA_MESSAGES,
                go_json(
                    [{"role": m.get("role", ""), "content": m.get("content", "")} for m in spec.messages],
                    sort_keys=False,
                ),
            )
        return layers
