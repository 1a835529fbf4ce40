"""
The nevers of ARCHITECTURE.md that import-linter cannot express (it cannot
forbid a submodule of an external package such as twisted.internet.reactor).
The layer contracts themselves run as `lint-imports` in ./dev.sh test.
"""

import ast
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import blazar

PACKAGE = Path(blazar.__file__).parent
ENTRY_POINTS = {"tap.py", "cli.py"}


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
            if path.name not in ENTRY_POINTS and imports_global_reactor(path.read_text())
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
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                )
                offenders += [f"{path.name}: {n}" for n in names if n.startswith(self.FORBIDDEN)]
        self.assertEqual(offenders, [])
