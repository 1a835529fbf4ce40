import hashlib
import json
from pathlib import Path
from typing import Any, cast

from twisted.trial.unittest import SynchronousTestCase

from blazar.models.hub import HubName, PullError, choose_files, choose_projector, parse_hub_name, target_paths


def f(path: str) -> dict:
    return {"type": "file", "path": path, "size": 1, "lfs": {"oid": "x", "size": 1}}


class HubTests(SynchronousTestCase):
    def test_names(self) -> None:
        self.assertEqual(parse_hub_name("hf.co/u/r:Q4_K_M"), HubName("u", "r", "Q4_K_M"))
        self.assertEqual(parse_hub_name("huggingface.co/u/r").tag, "latest")
        for bad in ["llama3", "hf.co/u", "hf.co/u/r/x", "hf.co/../r"]:
            with self.assertRaises(PullError, msg=bad) as cm:
                parse_hub_name(bad)
            self.assertEqual(cm.exception.status, 400)

    def test_choose_by_quant_and_default(self) -> None:
        files = [f("README.md"), f("m-Q8_0.gguf"), f("m-q4_k_m.gguf"), f("mmproj-m-F16.gguf")]
        self.assertEqual(choose_files(files, "Q8_0"), [files[1]])
        self.assertEqual(choose_files(files, "q4_k_m"), [files[2]])
        self.assertEqual(choose_files(files, "latest"), [files[2]])
        with self.assertRaises(PullError) as cm:
            choose_files(files, "Q2_K")
        self.assertIn("Q4_K_M, Q8_0", str(cm.exception))

    def test_split_models_take_every_shard(self) -> None:
        files = [f("big-Q4_K_M-00002-of-00002.gguf"), f("big-Q4_K_M-00001-of-00002.gguf")]
        chosen = choose_files(files, "Q4_K_M")
        self.assertEqual(
            [c["path"] for c in chosen], ["big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"]
        )
        self.assertEqual(
            [p.name for p in target_paths(Path("/m"), HubName("u", "r", "Q4_K_M"), chosen)],
            ["Q4_K_M-00001-of-00002.gguf", "Q4_K_M-00002-of-00002.gguf"],
        )

    def test_the_projector_is_the_f16_one_else_the_first(self) -> None:
        model = f("m-Q4_K_M.gguf")
        self.assertIsNone(choose_projector([model, f("README.md")]))
        bf16, f16, q8 = f("mmproj-m-BF16.gguf"), f("sub/mmproj-model-f16.gguf"), f("m.mmproj-Q8_0.gguf")
        self.assertEqual(choose_projector([model, bf16, f16, q8]), f16)
        self.assertEqual(choose_projector([model, q8, bf16]), q8)
        self.assertEqual(choose_projector([{"type": "directory", "path": "mmproj"}, q8]), q8)


class MemoryHub:
    """
    A hub (in memory, through StubTreq) serving C{files} of C{u/r}, and
    counting the downloads of each.
    """

    def __init__(self, files: dict[str, bytes]) -> None:
        from klein import Klein

        self.files = files
        self.downloads: dict[str, int] = {}
        app = Klein()

        @app.route("/api/models/u/r/tree/main")
        def tree(request: object) -> bytes:
            return json.dumps(
                [
                    {
                        "type": "file",
                        "path": path,
                        "size": len(data),
                        "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data)},
                    }
                    for path, data in self.files.items()
                ]
            ).encode()

        @app.route("/u/r/resolve/main/<path:path>")
        def resolve(request: object, path: str) -> bytes:
            self.downloads[path] = self.downloads.get(path, 0) + 1
            return self.files[path]

        self.resource = app.resource()


class LyingHub:
    """
    A hub (in memory, through StubTreq) whose listing gives C{listed} as
    the size of C{r.gguf} and whose download sends C{sent}.
    """

    def __init__(self, listed: bytes, sent: bytes) -> None:
        from klein import Klein

        self.listed, self.sent = listed, sent
        app = Klein()

        @app.route("/api/models/u/r/tree/main")
        def tree(request: object) -> bytes:
            return json.dumps(
                [
                    {
                        "type": "file",
                        "path": "r-Q4_K_M.gguf",
                        "size": len(self.listed),
                        "lfs": {"oid": hashlib.sha256(self.listed).hexdigest(), "size": len(self.listed)},
                    }
                ]
            ).encode()

        @app.route("/u/r/resolve/main/r-Q4_K_M.gguf")
        def resolve(request: object) -> bytes:
            return self.sent

        self.resource = app.resource()


class HubDownloadTests(SynchronousTestCase):
    """
    The hub's listed size bounds a download (issue 36): more is stopped at
    once and its partial file removed; less is an error that keeps the
    partial file to resume from.
    """

    def pull(
        self,
        hub: LyingHub | MemoryHub,
        tag: str = "Q4_K_M",
        models: Path | None = None,
        lines: list[dict[str, Any]] | None = None,
    ) -> tuple[Path, Any]:
        from treq.client import HTTPClient
        from treq.testing import StubTreq
        from twisted.internet.defer import ensureDeferred

        from blazar.models.hub import HubClient
        from blazar.testing import fake_process_reactor

        models = models or Path(self.mktemp())
        client = HubClient(fake_process_reactor(), "http://hub.test")
        client._http = cast(HTTPClient, StubTreq(hub.resource))  # a stand-in for the client
        progress = lines.append if lines is not None else (lambda line: None)
        return models, ensureDeferred(client.pull(HubName("u", "r", tag), models, progress))

    def test_the_repositorys_projector_comes_too(self) -> None:
        """
        A vision model's projector (issue 39): the repository's F16
        C{mmproj} is installed beside the quant pulled, with its own
        progress lines, and not fetched again for another quant.
        """
        weights, other, projector = b"GGUF q4" * 10, b"GGUF q8" * 10, b"GGUF projector f16" * 5
        hub = MemoryHub(
            {
                "r-Q4_K_M.gguf": weights,
                "r-Q8_0.gguf": other,
                "mmproj-r-BF16.gguf": b"GGUF bf16",
                "mmproj-r-F16.gguf": projector,
            }
        )
        lines: list[dict[str, Any]] = []
        models, d = self.pull(hub, lines=lines)
        folder = models / "hf.co" / "u" / "r"
        self.assertEqual(self.successResultOf(d), [folder / "Q4_K_M.gguf", folder / "mmproj-r-F16.gguf"])
        self.assertEqual((folder / "mmproj-r-F16.gguf").read_bytes(), projector)
        self.assertEqual(sorted(p.name for p in folder.iterdir()), ["Q4_K_M.gguf", "mmproj-r-F16.gguf"])
        sha = hashlib.sha256(projector).hexdigest()
        mine = [line for line in lines if line.get("digest") == f"sha256:{sha}"]
        self.assertEqual(
            mine[0],
            {"status": f"pulling {sha[:12]}", "digest": f"sha256:{sha}", "total": len(projector), "completed": 0},
        )
        self.assertEqual(mine[-1]["completed"], len(projector))
        self.assertEqual(
            [line["status"] for line in lines][-3:], ["verifying sha256 digest", "writing manifest", "success"]
        )
        # another quant of the repository: its projector is there already
        lines.clear()
        _, d = self.pull(hub, "Q8_0", models, lines)
        self.successResultOf(d)
        self.assertEqual(hub.downloads, {"r-Q4_K_M.gguf": 1, "mmproj-r-F16.gguf": 1, "r-Q8_0.gguf": 1})
        self.assertIn(
            {
                "status": f"pulling {sha[:12]}",
                "digest": f"sha256:{sha}",
                "total": len(projector),
                "completed": len(projector),
            },
            lines,
        )
        self.assertEqual(sorted(p.name for p in folder.iterdir()), ["Q4_K_M.gguf", "Q8_0.gguf", "mmproj-r-F16.gguf"])

    def test_more_than_listed_is_stopped_and_removed(self) -> None:
        models, d = self.pull(LyingHub(b"GGUF" * 8, b"GGUF" * 8 + b"x" * 4096))
        error = self.failureResultOf(d, PullError).value
        self.assertEqual(
            str(error),
            "http://hub.test sent more of r-Q4_K_M.gguf than the 32 bytes its listing "
            "gives; the download was stopped and its partial file removed. Check hf_endpoint in "
            "the config, then pull again",
        )
        self.assertEqual(error.status, 502)
        self.assertEqual([p for p in models.rglob("*") if p.is_file()], [])

    def test_less_than_listed_is_an_error_kept_to_resume(self) -> None:
        data = b"GGUF" * 8
        hub = LyingHub(data, data[:10])
        models, d = self.pull(hub)
        error = self.failureResultOf(d, PullError).value
        self.assertEqual(
            str(error),
            "download of r-Q4_K_M.gguf ended after 10 of the 32 bytes the hub's listing gives; pull again to resume",
        )
        (partial,) = (models / ".partial").iterdir()
        self.assertEqual(partial.read_bytes(), data[:10])
        self.assertFalse((models / "hf.co").exists())
