"""
The Modelfile parser and renderer against Ollama's own cases
(C{parser/parser_test.go}), Go's formatting of what C{/api/show} prints,
the parameter types, and the round trip render -> parse as a property.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from blazar.models.modelfile import (
    Command,
    ModelfileError,
    check_parameters,
    create_fields,
    decode,
    float32,
    go_float,
    go_json,
    go_quote,
    model_commands,
    parameter_value,
    parse,
    quote,
    render,
    render_command,
    show_modelfile,
    show_parameters,
)

LLAMA3 = (
    "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
    "{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>"
)


def C(name: str, args: str) -> Command:
    return Command(name, args)


class ParseTests(SynchronousTestCase):
    def refused(self, text: str) -> str:
        return str(self.assertRaises(ModelfileError, parse, text))

    def test_every_command(self) -> None:
        text = (
            "\nFROM model1\nADAPTER adapter1\nLICENSE MIT\nPARAMETER param1 value1\nPARAMETER param2 value2\n"
            'TEMPLATE """' + LLAMA3.replace("\n\n", "\n\n") + '"""    \n'
        )
        self.assertEqual(
            parse(text),
            [
                C("model", "model1"),
                C("adapter", "adapter1"),
                C("license", "MIT"),
                C("param1", "value1"),
                C("param2", "value2"),
                C("template", LLAMA3),
            ],
        )

    def test_commands_are_case_insensitive(self) -> None:
        self.assertEqual(
            parse("from a\nSystem hi\nparameter stop x\nMeSsAgE user yo\n"),
            [C("model", "a"), C("system", "hi"), C("stop", "x"), C("message", "user: yo")],
        )

    def test_parameter_names_keep_their_case(self) -> None:
        self.assertEqual(parse("FROM a\nPARAMETER Temperature 1")[1], C("Temperature", "1"))

    def test_newer_commands(self) -> None:
        self.assertEqual(
            parse("FROM base\nDRAFT ./assistant\nRENDERER r1\nPARSER p1\nREQUIRES 0.14.0\n")[1:],
            [C("draft", "./assistant"), C("renderer", "r1"), C("parser", "p1"), C("requires", "0.14.0")],
        )

    def test_trimmed_and_quoted_spaces(self) -> None:
        text = (
            '\nFROM "     model 1"\nADAPTER      adapter3\nLICENSE "MIT       "\nPARAMETER param1        value1\n'
            'PARAMETER param2    value2\nTEMPLATE """   {{ .Prompt }}   """    \n'
        )
        self.assertEqual(
            parse(text),
            [
                C("model", "     model 1"),
                C("adapter", "adapter3"),
                C("license", "MIT       "),
                C("param1", "value1"),
                C("param2", "value2"),
                C("template", "   {{ .Prompt }}   "),
            ],
        )

    def test_from(self) -> None:
        cases = {
            'FROM "FOO  BAR  "': [C("model", "FOO  BAR  ")],
            'FROM "FOO BAR"\nPARAMETER param1 value1': [C("model", "FOO BAR"), C("param1", "value1")],
            "FROM     FOOO BAR    ": [C("model", "FOOO BAR")],
            "FROM /what/is/the path ": [C("model", "/what/is/the path")],
            "FROM foo": [C("model", "foo")],
            "FROM llama3:7b-instruct-q4_K_M": [C("model", "llama3:7b-instruct-q4_K_M")],
            "PARAMETER param1 value1\nFROM foo": [C("param1", "value1"), C("model", "foo")],
            "PARAMETER what the \nFROM lemons make lemonade ": [C("what", "the"), C("model", "lemons make lemonade")],
        }
        for text, commands in cases.items():
            self.assertEqual(parse(text), commands, text)

    def test_no_from(self) -> None:
        for text in ("", "PARAMETER param1 value1", "# only a comment\n", "SYSTEM hi\n"):
            self.assertEqual(self.refused(text), "no FROM line", text)

    def test_parameter_without_a_value(self) -> None:
        self.assertEqual(self.refused("\nFROM foo\nPARAMETER param1\n"), "unexpected EOF: param1")
        self.assertEqual(self.refused("\nFROM foo\nPARAMETER param1"), "unexpected EOF")
        self.assertEqual(self.refused("FROM foo\nPARAMETER bad-name 1\n"), "unexpected EOF: bad")

    def test_bad_command(self) -> None:
        self.assertEqual(
            self.refused("\nFROM foo\nBADCOMMAND param1 value1\n"),
            '(line 3): command must be one of "from", "license", "template", "system", "adapter", '
            '"draft", "renderer", "parser", "parameter", "message", or "requires"',
        )
        # a command cut by a line end, or with a character a name cannot have
        self.assertIn("(line 2): command must be one of", self.refused("FROM\n"))
        self.assertIn("(line 1): command must be one of", self.refused("FROM: x\n"))
        self.assertEqual(self.refused("FROM foo\nSYSTEM"), "unexpected EOF")

    def test_line_numbers_count_every_line_end(self) -> None:
        # (a CR LF counts twice, as in Ollama's parser)
        self.assertIn("(line 3)", self.refused("FROM a\r\nNOPE x"))
        self.assertIn("(line 5)", self.refused('FROM a\nSYSTEM """\n\n"""\nNOPE x'))

    def test_messages(self) -> None:
        self.assertEqual(
            parse("\nFROM foo\nMESSAGE system You are a file parser. Always parse things.\n")[1],
            C("message", "system: You are a file parser. Always parse things."),
        )
        self.assertEqual(
            parse("FROM foo\nMESSAGE system Always parse things.")[1], C("message", "system: Always parse things.")
        )
        self.assertEqual(
            parse("FROM foo\nMESSAGE user Hey there!\nMESSAGE assistant Hello!\n")[1:],
            [C("message", "user: Hey there!"), C("message", "assistant: Hello!")],
        )
        self.assertEqual(
            parse('FROM foo\nMESSAGE system """\nYou are multiline.\n"""\n\t\t\t')[1],
            C("message", "system: \nYou are multiline.\n"),
        )

    def test_message_roles(self) -> None:
        self.assertEqual(
            self.refused("\nFROM foo\nMESSAGE badguy I'm a bad guy!\n"),
            '(line 3): message role must be one of "system", "user", or "assistant"',
        )
        self.assertIn("message role", self.refused("FROM foo\nMESSAGE User hi\n"))  # roles are case-sensitive
        self.assertEqual(self.refused("\nFROM foo\nMESSAGE system\n"), "unexpected EOF: system")
        self.assertEqual(self.refused("\nFROM foo\nMESSAGE system"), "unexpected EOF")

    def test_quoted(self) -> None:
        cases = {
            'FROM foo\nSYSTEM """\nThis is a\nmultiline system.\n"""\n\t\t\t': "\nThis is a\nmultiline system.\n",
            'FROM foo\nSYSTEM """\nThis is a\nmultiline system."""\n': "\nThis is a\nmultiline system.",
            'FROM foo\nSYSTEM """This is a\nmultiline system."""\n': "This is a\nmultiline system.",
            'FROM foo\nSYSTEM """This is a multiline system."""\n': "This is a multiline system.",
            'FROM foo\nSYSTEM """\nwith "quotes".\n"""\n': '\nwith "quotes".\n',
            'FROM foo\nSYSTEM """"""\n': "",
            'FROM foo\nSYSTEM ""\n': "",
            'FROM foo\nSYSTEM "\'"\n': "'",
            'FROM foo\nSYSTEM """\'\'"\'""\'""\'"\'\'\'\'\'""\'""\'"""\n': "''\"'\"\"'\"\"'\"'''''\"\"'\"\"'",
            'FROM foo\nTEMPLATE """\n{{ .Prompt }}\n"""': "\n{{ .Prompt }}\n",
            'FROM foo\nSYSTEM He said "hi"\n': 'He said "hi"',
            "FROM foo\nSYSTEM # not a comment\n": "# not a comment",
            'FROM foo\nSYSTEM "a\r\nb"\r\n': "a\r\nb",
        }
        for text, value in cases.items():
            self.assertEqual(parse(text)[1].args, value, text)

    def test_unclosed_quotes(self) -> None:
        for text in (
            'FROM foo\nSYSTEM """This is a multiline system.""\n\t\t\t',
            'FROM foo\nSYSTEM "\n\t\t\t',
            'FROM foo\nSYSTEM """',
            'FROM foo\nSYSTEM "a" b\n',
        ):
            self.assertEqual(self.refused(text), "unexpected EOF", text)

    def test_parameters(self) -> None:
        cases = {
            "num_ctx 1": ("num_ctx", "1"),
            "use_mmap true": ("use_mmap", "true"),
            "top_p 1.0": ("top_p", "1.0"),
            "stop ### User:": ("stop", "### User:"),
            "stop ### User: ": ("stop", "### User:"),
            'stop "### User:"': ("stop", "### User:"),
            'stop "### User: "': ("stop", "### User: "),
            'stop """### User:"""': ("stop", "### User:"),
            'stop """### User:\n"""': ("stop", "### User:\n"),
            "stop <|endoftext|>": ("stop", "<|endoftext|>"),
            "stop </s>": ("stop", "</s>"),
        }
        for line, (name, value) in cases.items():
            self.assertEqual(parse(f"FROM foo\nPARAMETER {line}\n"), [C("model", "foo"), C(name, value)], line)

    def test_comments_and_blank_lines(self) -> None:
        self.assertEqual(parse("\n# comment\nFROM foo\n\t"), [C("model", "foo")])
        self.assertEqual(
            parse("   # indented comment\n\n\nFROM foo # not a comment\n"), [C("model", "foo # not a comment")]
        )

    def test_unprintable_characters_are_dropped(self) -> None:
        self.assertEqual(parse("FROM foo\nSYSTEM a\x00b\u00a0c\x7fd\n")[1], C("system", "abcd"))
        self.assertEqual(parse("FROM foo\nSYSTEM a\tb\n")[1], C("system", "a\tb"))

    def test_multibyte_and_byte_order_marks(self) -> None:
        text = "FROM test\n\tSYSTEM 你好👋"
        expected = [C("model", "test"), C("system", "你好👋")]
        for data in (
            text.encode(),
            b"\xef\xbb\xbf" + text.encode(),
            text.encode("utf-16"),
            b"\xff\xfe" + text.encode("utf-16-le"),
            b"\xfe\xff" + text.encode("utf-16-be"),
        ):
            self.assertEqual(parse(decode(data)), expected, data[:4])
        self.assertEqual(parse("\ufeffFROM x"), [C("model", "x")])
        self.assertEqual(decode(b"FROM \xff"), "FROM \ufffd")


class RenderTests(SynchronousTestCase):
    def test_quote(self) -> None:
        self.assertEqual(quote("plain"), "plain")
        self.assertEqual(quote('has "quotes"'), 'has "quotes"')
        self.assertEqual(quote(" lead"), '" lead"')
        self.assertEqual(quote("trail "), '"trail "')
        self.assertEqual(quote("two\nlines"), '"two\nlines"')
        self.assertEqual(quote('two\n"lines"'), '"""two\n"lines""""')

    def test_commands(self) -> None:
        self.assertEqual(render_command(C("model", "/blobs/sha256-ab")), "FROM /blobs/sha256-ab")
        self.assertEqual(render_command(C("system", "be\nbrief")), 'SYSTEM "be\nbrief"')
        self.assertEqual(render_command(C("message", "user: hi: there")), "MESSAGE user hi: there")
        self.assertEqual(render_command(C("stop", "<|im_end|>")), "PARAMETER stop <|im_end|>")
        self.assertEqual(render_command(C("draft", "d")), "DRAFT d")
        self.assertEqual(str(C("license", "MIT")), "LICENSE MIT")

    def test_ollama_round_trips(self) -> None:
        for text in [
            "\nFROM foo\nADAPTER adapter1\nLICENSE MIT\nPARAMETER param1 value1\nTEMPLATE template1\n"
            "MESSAGE system You are a file parser.\nMESSAGE user Hey there!\n",
            '\nFROM foo\nLICENSE """\nVery long and boring legal text.\n"Oh look, a quote!"\n"""\n\n'
            'MESSAGE system """\nYou are a store greeter. Always respond with "Hello!".\n"""\n',
            '\nFROM foo\nSYSTEM ""\n',
        ]:
            commands = parse(text)
            self.assertEqual(parse(render(commands)), commands)

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["system", "template", "license", "adapter", "message", "stop", "num_ctx"]),
                st.text(
                    st.characters(blacklist_categories=("Cs", "Cc", "Cf", "Zl", "Zp", "Zs", "Cn", "Co"))
                    | st.sampled_from([" ", "\n", '"', "#"]),
                    max_size=30,
                ),
                st.sampled_from(["system", "user", "assistant"]),
            ),
            max_size=6,
        )
    )
    def test_what_renders_parses_back(self, items: list[tuple[str, str, str]]) -> None:
        """
        What the renderer writes parses back to the same commands, except
        where Ollama's own renderer loses (values that are both quoted and
        end or start with a quote, and leading or trailing line ends it
        leaves bare): those are skipped, not fixed, to stay Ollama's.
        """
        commands = [C("model", "base")]
        for name, value, role in items:
            if name == "message":
                commands.append(C("message", f"{role}: {value}"))
            else:
                commands.append(C(name, value))
        for command in commands[1:]:
            value = command.args.partition(": ")[2] if command.name == "message" else command.args
            quoted = quote(value)
            if quoted == value and (value != value.strip(" \t\r\n") or value.startswith('"') or value == ""):
                return  # bare, and not what it was once trimmed or unquoted (Ollama's renderer loses it)
            if quoted.startswith('"') and (value.startswith('"') or value.endswith('"')):
                return
        self.assertEqual(parse(render(commands)), commands)


class ParameterTests(SynchronousTestCase):
    def test_types(self) -> None:
        self.assertEqual(parameter_value("num_ctx", "4096"), 4096)
        self.assertEqual(parameter_value("seed", "-1"), -1)
        self.assertEqual(parameter_value("seed", "+3"), 3)
        self.assertEqual(parameter_value("temperature", "0.7"), 0.7)
        self.assertEqual(parameter_value("temperature", "1"), 1.0)
        self.assertEqual(parameter_value("top_p", ".5e0"), 0.5)
        self.assertEqual(parameter_value("top_p", "0.123456789"), 0.12345679)  # a float32, as Ollama keeps it
        self.assertIs(parameter_value("use_mmap", "T"), True)
        self.assertIs(parameter_value("use_mmap", "0"), False)
        self.assertEqual(parameter_value("stop", "</s>"), "</s>")

    def test_refusals(self) -> None:
        cases = {
            ("nope", "1"): "unknown parameter 'nope'",
            ("Temperature", "1"): "unknown parameter 'Temperature'",
            ("num_ctx", "4k"): "invalid int value [4k]",
            ("num_ctx", "1_000"): "invalid int value [1_000]",
            ("num_ctx", "1.0"): "invalid int value [1.0]",
            ("num_ctx", "99999999999999999999"): "invalid int value [99999999999999999999]",
            ("temperature", "warm"): "invalid float value [warm]",
            ("temperature", "nan"): "invalid float value [nan]",
            ("temperature", "1e39"): "invalid float value [1e39]",
            ("use_mmap", "yes"): "invalid bool value [yes]",
        }
        for (name, value), message in cases.items():
            self.assertEqual(str(self.assertRaises(ModelfileError, parameter_value, name, value)), message)

    def test_float32(self) -> None:
        self.assertEqual(float32(0.1), 0.1)
        self.assertEqual(float32(1 / 3), 0.33333334)
        self.assertEqual(float32(0.0), 0.0)

    def test_checked_json_parameters(self) -> None:
        params, dropped = check_parameters(
            {"num_predict": 5.0, "temperature": 0, "stop": "x", "seed": None, "low_vram": True, "use_mmap": False}
        )
        self.assertEqual(params, {"num_predict": 5, "temperature": 0.0, "stop": ["x"], "use_mmap": False})
        self.assertEqual(type(params["num_predict"]), int)
        self.assertEqual(dropped, ["low_vram"])
        self.assertEqual(check_parameters(None), ({}, []))
        for bad, message in [
            ([], "parameters must be an object"),
            ({"what": 1}, "unknown parameter 'what'"),
            ({"num_ctx": 1.5}, "parameter num_ctx must be an integer, got 1.5"),
            ({"num_ctx": True}, "parameter num_ctx must be an integer"),
            ({"temperature": "hot"}, "parameter temperature must be a number"),
            ({"temperature": float("inf")}, "parameter temperature must be a number"),
            ({"use_mmap": 1}, "parameter use_mmap must be true or false"),
            ({"stop": ["a", 1]}, "parameter stop must be a string or an array of strings"),
        ]:
            self.assertIn(message, str(self.assertRaises(ModelfileError, check_parameters, bad)))


class GoFormatTests(SynchronousTestCase):
    def test_floats_as_go_prints_them(self) -> None:
        cases = {
            0.7: "0.7",
            4096.0: "4096",
            1e6: "1e+06",
            123456.0: "123456",
            1234567.0: "1.234567e+06",
            1e-5: "1e-05",
            1.5e-5: "1.5e-05",
            0.0001: "0.0001",
            0.00012: "0.00012",
            -2.5: "-2.5",
            0.0: "0",
            1e21: "1e+21",
            100.0: "100",
            12.5: "12.5",
            float("inf"): "+Inf",
            float("nan"): "NaN",
        }
        for value, text in cases.items():
            self.assertEqual(go_float(value), text, value)
        self.assertEqual(go_float(-0.0), "-0")

    def test_quote(self) -> None:
        self.assertEqual(go_quote("<|im_end|>"), '"<|im_end|>"')
        self.assertEqual(go_quote('a"b\\c\nd\te'), '"a\\"b\\\\c\\nd\\te"')
        self.assertEqual(go_quote("ü\x01\u200b"), '"ü\\x01\\u200b"')

    def test_show_parameters(self) -> None:
        self.assertEqual(
            show_parameters({"num_ctx": 4096, "stop": ["<|im_end|>", "</s>"], "temperature": 0.7, "use_mmap": False}),
            "num_ctx                        4096\n"
            'stop                           "<|im_end|>"\n'
            'stop                           "</s>"\n'
            "temperature                    0.7\n"
            "use_mmap                       false",
        )
        self.assertEqual(show_parameters({}), "")

    def test_go_json(self) -> None:
        data = go_json({"temperature": 1.0, "stop": ["<|im_end|>", "a&b"], "num_ctx": 4096, "top_p": 0.9})
        self.assertEqual(
            data, b'{"num_ctx":4096,"stop":["\\u003c|im_end|\\u003e","a\\u0026b"],"temperature":1,"top_p":0.9}\n'
        )
        self.assertEqual(json.loads(data)["stop"], ["<|im_end|>", "a&b"])
        self.assertEqual(go_json([{"role": "user", "content": "é"}]), '[{"content":"é","role":"user"}]\n'.encode())


class CreateFieldsTests(SynchronousTestCase):
    def test_a_modelfile_as_a_create_request(self) -> None:
        fields = create_fields(
            parse(
                "FROM test\nPARAMETER temperature 0.5\nPARAMETER top_k 1\nPARAMETER stop a\nPARAMETER stop b\n"
                "SYSTEM You are a bot.\nTEMPLATE {{ .Prompt }}\nLICENSE license1\nLICENSE license2\n"
                "MESSAGE user Hello there!\nMESSAGE assistant Hi! How are you?\n"
            )
        )
        self.assertEqual(fields.source, "test")
        self.assertEqual(fields.system, "You are a bot.")
        self.assertEqual(fields.template, "{{ .Prompt }}")
        self.assertEqual(fields.license, ("license1", "license2"))
        self.assertEqual(fields.parameters, {"temperature": 0.5, "top_k": 1, "stop": ["a", "b"]})
        self.assertEqual(
            fields.messages,
            ({"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi! How are you?"}),
        )
        self.assertEqual(fields.ignored, ())

    def test_uploaded_blobs(self) -> None:
        digest = "ab" * 32
        fields = create_fields(parse(f"FROM @sha256:{digest.upper()}\nADAPTER @sha256-{digest}\n"))
        self.assertEqual(
            (fields.source, dict(fields.files), dict(fields.adapters)),
            (None, {"model.gguf": f"sha256:{digest}"}, {"adapter.gguf": f"sha256:{digest}"}),
        )

    def test_client_paths_are_refused(self) -> None:
        for line in (
            "FROM ./model.gguf",
            "FROM /srv/m",
            "FROM ~/m",
            "FROM m.gguf",
            "ADAPTER lora",
            "FROM C:\\models\\m",
        ):
            error = self.assertRaises(ModelfileError, create_fields, parse(line + "\nFROM base\n"))
            self.assertIn("upload it first (POST /api/blobs/sha256:<hex>)", str(error))

    def test_ignored_and_refused(self) -> None:
        fields = create_fields(
            parse("FROM a\nRENDERER r\nPARSER p\nDRAFT d\nREQUIRES 0.1.0\nPARAMETER penalize_newline true\n")
        )
        self.assertEqual(fields.ignored, ("RENDERER", "PARSER", "DRAFT", "REQUIRES", "PARAMETER penalize_newline"))
        self.assertRaises(ModelfileError, create_fields, parse("FROM a\nPARAMETER num_ctx big\n"))


class ShowModelfileTests(SynchronousTestCase):
    def test_ollama_order_and_header(self) -> None:
        commands = model_commands(
            "/root/blobs/sha256-aa",
            adapters=["/root/blobs/sha256-bb"],
            projectors=["/root/blobs/sha256-cc"],
            system="Be brief.",
            parameters={"stop": ["<|im_end|>"], "temperature": 0.7, "num_ctx": 4096},
            license=["MIT"],
            messages=[{"role": "user", "content": "hi"}],
        )
        self.assertEqual(
            show_modelfile("mine:latest", commands),
            '# Modelfile generated by "ollama show"\n'
            "# To build a new Modelfile based on this, replace FROM with:\n"
            "# FROM mine:latest\n\n"
            "FROM /root/blobs/sha256-aa\n"
            "ADAPTER /root/blobs/sha256-bb\n"
            "FROM /root/blobs/sha256-cc\n"
            "TEMPLATE {{ .Prompt }}\n"
            "SYSTEM Be brief.\n"
            "PARAMETER stop <|im_end|>\n"
            "PARAMETER temperature 0.7\n"
            "PARAMETER num_ctx 4096\n"
            "LICENSE MIT\n"
            "MESSAGE user hi\n",
        )

    def test_what_show_renders_parses_back(self) -> None:
        template = '{{ if .System }}{{ .System }}\n{{ end }}"{{ .Prompt }}"'
        commands = model_commands("m", template=template, system=" spaced ", parameters={"stop": ["a b"]})
        self.assertEqual(parse(render(commands)), commands)
