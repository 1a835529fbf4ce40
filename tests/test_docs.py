"""
The documentation's links hold: every relative link and image in README.md,
CHANGELOG.md and docs/**/*.md names a file that exists, and every
C{#anchor} names a heading of its page as GitHub slugs it. The README stays
a front door (at most 300 lines), and every docs/ page is in the index.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from blazar.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target may carry a "title"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_TOML = re.compile(r"^```toml\n(.*?)^```", re.S | re.M)
# what a page writes where a real secret goes (`blazar keys add NAME` makes one)
_SECRET = re.compile(r'"blz-\.\.\."')


def config_examples(page: Path) -> list[tuple[int, str]]:
    """
    The Blazar config examples of C{page}: its C{toml} blocks with their
    line numbers, less those that are another program's (a first line such
    as C{# ~/.codex/config.toml}).
    """
    text = page.read_text()
    secrets = iter(range(1000))
    return [
        (text[: m.start()].count("\n") + 1, _SECRET.sub(lambda _: f'"blz-example-secret-{next(secrets)}"', m.group(1)))
        for m in _TOML.finditer(text)
        if not m.group(1).startswith("# ~/")
    ]


def pages() -> list[Path]:
    """
    The Markdown files whose links are checked.
    """
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    found += sorted(DOCS.rglob("*.md"))
    return [path for path in found if path.exists()]


def prose_lines(text: str) -> list[str]:
    """
    C{text}'s lines outside fenced code blocks.
    """
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """
    GitHub's anchor for a heading's Markdown text: its rendered text
    lowercased, with everything but letters, marks, digits, connector
    punctuation, spaces and hyphens dropped, and spaces as hyphens.
    """
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*)", "", text)  # emphasis (a lone _ is kept)
    kept = "".join(
        ch for ch in text.lower() if ch.isalnum() or ch in " -_" or unicodedata.category(ch) in ("Mn", "Mc", "Me", "Pc")
    )
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """
    Every anchor GitHub makes for C{text}'s headings (a repeated slug gets
    C{-1}, C{-2}, ...).
    """
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[str]:
    """
    The targets of C{text}'s Markdown links and images, outside code.
    """
    found = []
    for line in prose_lines(text):
        found += _LINK.findall(_CODE_SPAN.sub("", line))
    return found


def broken_links(page: Path) -> list[str]:
    """
    C{page}'s relative links whose file, or whose anchor, does not exist.
    """
    broken = []
    for target in links(page.read_text()):
        if not target or _SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}: {target}"
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{where} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{where} (no such heading)")
    return broken


class SlugTests(SynchronousTestCase):
    """
    The anchors are GitHub's.
    """

    CASES = {
        "The `blazar` command": "the-blazar-command",
        "Leniency: every field real clients send": "leniency-every-field-real-clients-send",
        "Modelfiles and `/api/create`": "modelfiles-and-apicreate",
        "On a GPU: `scripts/gpu-check.sh`": "on-a-gpu-scriptsgpu-checksh",
        "Network, TLS, CORS and auditing": "network-tls-cors-and-auditing",
        "[Docs](docs/README.md) and *more*": "docs-and-more",
        "snake_case ok": "snake_case-ok",
    }

    def test_slugs(self) -> None:
        self.assertEqual({heading: slug(heading) for heading in self.CASES}, self.CASES)

    def test_repeated_headings(self) -> None:
        text = "# A\n## What differs\n```\n# not a heading\n```\n## What differs\n"
        self.assertEqual(anchors(text), {"a", "what-differs", "what-differs-1"})

    def test_links_outside_code(self) -> None:
        text = '[a](x.md) `[b](y.md)` ![c](i.png "t")\n```\n[d](z.md)\n```\n[e](https://e.org)\n'
        self.assertEqual(links(text), ["x.md", "i.png", "https://e.org"])


class DocsTests(SynchronousTestCase):
    def test_pages_exist(self) -> None:
        self.assertIn(ROOT / "README.md", pages())
        self.assertIn(ROOT / "CHANGELOG.md", pages())
        self.assertIn(DOCS / "README.md", pages())

    def test_every_link_resolves(self) -> None:
        broken = [line for page in pages() for line in broken_links(page)]
        self.assertEqual(broken, [])

    def test_readme_is_a_front_door(self) -> None:
        lines = (ROOT / "README.md").read_text().count("\n")
        self.assertLessEqual(lines, README_MAX_LINES)

    def test_index_lists_every_page(self) -> None:
        index = DOCS / "README.md"
        linked = {(DOCS / target.partition("#")[0]).resolve() for target in links(index.read_text())}
        missing = [
            str(page.relative_to(ROOT))
            for page in sorted(DOCS.rglob("*.md"))
            if page != index and page.resolve() not in linked
        ]
        self.assertEqual(missing, [])

    def test_config_examples_parse(self) -> None:
        """
        Every Blazar config example in the docs is a config Blazar takes
        (one pasted whole once put top-level keys under [cache] and [queue]).
        """
        refused = []
        for page in pages():
            for line, example in config_examples(page):
                try:
                    parse_config(example)
                except ConfigError as e:
                    refused.append(f"{page.relative_to(ROOT)}:{line}: {e}")
        self.assertEqual(refused, [])
