"""
The gateway is free of HTTP: nothing below C{blazar.web} names the
client's request (C{IRequest}) or types one as C{Any}. The import-linter
contract "No HTTP server below blazar.web" forbids twisted.web.server,
twisted.web.resource and klein there; it lets the engine HTTP client and
the fetchers import twisted.web.iweb for its client-side interfaces, so
this test keeps C{IRequest} out of them.
"""

from __future__ import annotations

import re
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import blazar

ROOT = Path(blazar.__file__).parent
BELOW_WEB = ("gateway", "engines", "models", "protocols")
LEAK = re.compile(r"request: Any|IRequest|notifyFinish|\.getHeader\(|\.setHeader\(")


class FreeOfHTTPTests(SynchronousTestCase):
    def test_no_request_below_the_web(self) -> None:
        found = [
            f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}"
            for room in BELOW_WEB
            for path in sorted((ROOT / room).rglob("*.py"))
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if LEAK.search(line)
        ]
        self.assertEqual(found, [])
