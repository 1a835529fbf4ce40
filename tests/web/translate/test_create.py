"""
Ollama's C{/api/create} bodies, the JSON form and the legacy Modelfile
form, decoded (L{blazar.web.translate.create}).
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from blazar.web.translate.create import CreateRefused, decode_create

DIGEST = "sha256:" + "ab" * 32


class DecodeCreateTests(SynchronousTestCase):
    def refused(self, body: dict[str, Any]) -> str:
        return str(self.assertRaises(CreateRefused, decode_create, body))

    def test_the_json_form(self) -> None:
        spec, ignored = decode_create(
            {
                "model": "mine",
                "from": "smollm",
                "files": {"model.gguf": DIGEST},
                "adapters": {"a.gguf": DIGEST},
                "template": "{{ .Prompt }}",
                "system": "Be brief.",
                "license": ["MIT", "Apache"],
                "parameters": {"num_predict": 3, "stop": "x", "temperature": 0},
                "quantize": "q8_0",
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
                "stream": True,
            }
        )
        self.assertEqual(spec.name.display, "mine:latest")
        self.assertEqual(
            (spec.source, dict(spec.files), dict(spec.adapters)), ("smollm", {"model.gguf": DIGEST}, {"a.gguf": DIGEST})
        )
        self.assertEqual((spec.template, spec.system, spec.license), ("{{ .Prompt }}", "Be brief.", ("MIT", "Apache")))
        self.assertEqual(dict(spec.parameters), {"num_predict": 3, "stop": ["x"], "temperature": 0.0})
        self.assertEqual(spec.messages, ({"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}))
        self.assertEqual((spec.quantize, spec.asked_quantize), ("Q8_0", "Q8_0"))
        self.assertEqual(ignored, ["template"])  # recorded and shown, never applied

    def test_names_and_defaults(self) -> None:
        spec, ignored = decode_create(
            {
                "name": "ns/Mine:v1",
                "from": "x",
                "quantization": "Q4_K_M",
                "license": "MIT",
                "renderer": "r",
                "mystery": 1,
            }
        )
        self.assertEqual((spec.name.display, spec.quantize, spec.license), ("ns/Mine:v1", "Q4_K_M", ("MIT",)))
        self.assertEqual((spec.messages, dict(spec.parameters), spec.template), (None, {}, None))
        self.assertEqual(ignored, ["renderer", "mystery"])
        spec, _ = decode_create({"model": "m", "from": "x", "quantize": "q4_k_m"})
        self.assertEqual((spec.quantize, spec.asked_quantize), ("Q4_K_M", "Q4_K_M"))

    def test_the_legacy_modelfile_form(self) -> None:
        spec, ignored = decode_create(
            {
                "name": "old",
                "modelfile": (
                    f'FROM @{DIGEST}\nSYSTEM """Be\nbrief."""\nPARAMETER stop <|im_end|>\nPARAMETER num_ctx 2048\n'
                    "TEMPLATE {{ .Prompt }}\nMESSAGE user hi\nLICENSE MIT\nPARSER x\n"
                ),
            }
        )
        self.assertEqual((spec.source, dict(spec.files)), (None, {"model.gguf": DIGEST}))
        self.assertEqual((spec.system, spec.template, spec.license), ("Be\nbrief.", "{{ .Prompt }}", ("MIT",)))
        self.assertEqual(dict(spec.parameters), {"stop": ["<|im_end|>"], "num_ctx": 2048})
        self.assertEqual(spec.messages, ({"role": "user", "content": "hi"},))
        self.assertEqual(ignored, ["PARSER", "template"])
        spec, _ = decode_create({"name": "old", "modelfile": "FROM smollm\n", "system": "over"})
        self.assertEqual((spec.source, spec.system), ("smollm", "over"))
        # with the JSON fields, the Modelfile is what older clients also sent: not read
        spec, _ = decode_create({"model": "new", "from": "base", "modelfile": "FROM other\n"})
        self.assertEqual(spec.source, "base")

    def test_refusals(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            ({}, "model is required"),
            ({"model": "a/b/c/d"}, "invalid model name"),
            ({"model": "m", "path": "/srv/Modelfile"}, "path (a Modelfile on the server) is not supported"),
            ({"model": "m", "modelfile": "FROM\n"}, "(line 2): command must be one of"),
            ({"model": "m", "modelfile": "SYSTEM x\n"}, "no FROM line"),
            ({"model": "m", "modelfile": "FROM ./m.gguf\n"}, "upload it first"),
            ({"model": "m", "modelfile": "FROM x\nPARAMETER num_ctx big\n"}, "invalid int value [big]"),
            ({"model": "m", "files": {"../m.gguf": DIGEST}}, "file path must be relative"),
            ({"model": "m", "files": {"/m.gguf": DIGEST}}, "file path must be relative"),
            ({"model": "m", "files": {"m.gguf": ""}}, "invalid digest format"),
            ({"model": "m", "files": {"m.gguf": "md5:x"}}, "invalid digest format"),
            ({"model": "m", "files": ["m.gguf"]}, "files must be an object"),
            ({"model": "m", "from": 3}, "from must be a string"),
            ({"model": "m", "from": "x", "parameters": {"nope": 1}}, "unknown parameter 'nope'"),
            ({"model": "m", "from": "x", "parameters": {"num_ctx": "4k"}}, "parameter num_ctx must be an integer"),
            ({"model": "m", "from": "x", "messages": "hi"}, "messages must be an array"),
            ({"model": "m", "from": "x", "messages": [{"content": "hi"}]}, "messages[0] must be an object"),
            ({"model": "m", "from": "x", "license": 3}, "license must be a string or an array"),
            ({"model": "m", "from": "x", "quantize": "q9_9"}, "unknown quantization type 'q9_9'"),
            ({"model": "m", "from": "x", "quantize": "iq2_xs"}, "needs an importance matrix"),
            ({"model": "m", "from": "x", "quantize": 8}, "quantize must be a string"),
        ]
        for body, message in cases:
            self.assertIn(message, self.refused(body), body)

    def test_deprecated_parameters_are_named(self) -> None:
        _, ignored = decode_create({"model": "m", "from": "x", "parameters": {"f16_kv": True}})
        self.assertEqual(ignored, ["parameters.f16_kv"])
