from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar.models.hub import HubName, PullError, choose_files, parse_hub_name, target_paths


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
        self.assertEqual([c["path"] for c in chosen],
                         ["big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"])
        self.assertEqual(
            [p.name for p in target_paths(Path("/m"), HubName("u", "r", "Q4_K_M"), chosen)],
            ["Q4_K_M-00001-of-00002.gguf", "Q4_K_M-00002-of-00002.gguf"],
        )
