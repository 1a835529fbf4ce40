"""
The nevers of docs/architecture.md that import-linter cannot express (it
cannot forbid a submodule of an external package such as
twisted.internet.reactor), and that page kept true to the code: every module
an import-linter contract names is on it, and every file it names exists.
The layer contracts themselves run as `lint-imports` in ./dev.sh test and
./dev.sh unit.
"""

import ast
import re
import tomllib
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import blazar

PACKAGE = Path(blazar.__file__).parent
ROOT = PACKAGE.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ENTRY_POINTS = {"tap.py", "cli"}  # blazar/tap.py and the blazar/cli/ package


def imports_global_reactor(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "twisted.internet":
            if any(alias.name == "reactor" for alias in node.names):
                return True
        if isinstance(node, ast.Import):
            if any(alias.name == "twisted.internet.reactor" for alias in node.names):
                return True
    return False


class GlobalReactorTests(SynchronousTestCase):
    def test_detector(self) -> None:
        self.assertTrue(imports_global_reactor("from twisted.internet import reactor"))
        self.assertTrue(imports_global_reactor("def f():\n    import twisted.internet.reactor"))
        self.assertFalse(imports_global_reactor("from twisted.internet import task"))

    def test_only_entry_points_import_the_global_reactor(self) -> None:
        offenders = [
            str(path.relative_to(PACKAGE))
            for path in PACKAGE.rglob("*.py")
            if path.relative_to(PACKAGE).parts[0] not in ENTRY_POINTS and imports_global_reactor(path.read_text())
        ]
        self.assertEqual(offenders, [])


class PureTranslatorTests(SynchronousTestCase):
    """
    blazar.web.translate is pure: no reactor, no network, no disk.
    """

    FORBIDDEN = ("twisted.internet", "twisted.web", "blazar.engines", "blazar.store", "sqlite3", "socket")

    def test_translators_import_no_io(self) -> None:
        offenders = []
        for path in (PACKAGE / "web" / "translate").glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
                )
                offenders += [f"{path.name}: {n}" for n in names if n.startswith(self.FORBIDDEN)]
        self.assertEqual(offenders, [])


SURFACES = ("openai.py", "responses.py", "anthropic.py", "ollama.py")
# what only the pipeline (blazar/gateway/pipeline.py) may touch: the
# supervisor, the engine client and its calls, admission, a child's
# in_flight count
ORCHESTRATION = (
    "supervisor",
    "EngineProxy",
    "EngineClient",
    "engine_proxy.EngineProxy",
    ".send(",
    "instance_for",
    "in_flight",
    "admit_request",
    ".admission",
    "Admission",
    "stop_instance",
    "relay_chunks",
    "count_chat_tokens",
    "count_text_tokens",
    "preflight(",
    "check_scope",
    "check_purpose",
    "place_system_messages",
)


def orchestration_in(source: str) -> list[str]:
    """
    The orchestration names C{source}'s code uses (not its docstrings or
    comments).
    """
    code = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Name, ast.Attribute)):
            code.append(ast.unparse(node))
        if isinstance(node, ast.alias):  # what is imported, not from where
            code.append(node.name)
        if isinstance(node, ast.Call):
            code.append(ast.unparse(node.func) + "(")
    text = "\n".join(code)
    return sorted({name for name in ORCHESTRATION if name in text})


class SurfacesDoNotOrchestrateTests(SynchronousTestCase):
    """
    A surface decodes its JSON into a call for the pipeline and encodes what
    comes back; it never calls the supervisor, the engine client or
    admission itself (docs/architecture.md).
    """

    def test_detector(self) -> None:
        self.assertEqual(orchestration_in("async def f(self):\n    await self._proxy.send(m)\n"), [".send("])
        self.assertEqual(orchestration_in("x = self._supervisor.loaded(m)\n"), ["supervisor"])
        self.assertEqual(orchestration_in('"""the supervisor"""\n# admission\nx = 1\n'), [])

    def test_no_surface_orchestrates(self) -> None:
        found = {name: orchestration_in((PACKAGE / "web" / name).read_text()) for name in SURFACES}
        self.assertEqual(found, {name: [] for name in SURFACES})


def contract_modules(pyproject: str) -> set[str]:
    """
    Every C{blazar} module the import-linter contracts of C{pyproject}
    name: layers (C{a | b} is two), sources, forbidden and ignored ends.
    """
    found: set[str] = set()
    for contract in tomllib.loads(pyproject)["tool"]["importlinter"]["contracts"]:
        for field in ("layers", "containers", "source_modules", "forbidden_modules", "modules"):
            for entry in contract.get(field, []):
                found.update(part.strip() for part in entry.split("|"))
    return {name for name in found if name.split(".")[0] == "blazar"}


def named_paths(text: str) -> set[str]:
    """
    The repository paths C{text} names in code spans or diagrams: words
    under blazar/, tests/, scripts/, bench/ or docs/.
    """
    return set(re.findall(r"\b((?:blazar|tests|scripts|bench|docs)/[\w./-]*\w/?)", text))


class ArchitecturePageTests(SynchronousTestCase):
    """
    docs/architecture.md is the map of the rooms: it names every module the
    contracts name, and nothing that is not there.
    """

    def test_detectors(self) -> None:
        pyproject = (
            '[[tool.importlinter.contracts]]\nname = "r"\ntype = "layers"\n'
            'layers = ["blazar.cli | blazar.tap", "blazar.web", "twisted.web"]\n'
        )
        self.assertEqual(
            contract_modules("[tool.importlinter]\n" + pyproject), {"blazar.cli", "blazar.tap", "blazar.web"}
        )
        self.assertEqual(
            named_paths("`blazar/web/site.py` and tests/web/, not blazarish/x"), {"blazar/web/site.py", "tests/web/"}
        )

    def test_every_contract_module_is_on_the_map(self) -> None:
        text = ARCHITECTURE.read_text()
        missing = sorted(
            name
            for name in contract_modules((ROOT / "pyproject.toml").read_text())
            if name not in text and name.replace(".", "/") not in text and f"`{name.rsplit('.', 1)[-1]}.py`" not in text
        )
        self.assertEqual(missing, [])

    def test_every_file_on_the_map_exists(self) -> None:
        missing = sorted(path for path in named_paths(ARCHITECTURE.read_text()) if not (ROOT / path).exists())
        self.assertEqual(missing, [])
