"""Check every internal link of a built HTML tree (``nox -s docs``: the pdoc API reference).

    python docs/check_links.py .nox/docs/html

Each ``href``/``src`` of every ``.html`` page that is not an absolute URL (a scheme, or ``//``)
must name a file inside the tree, and its ``#fragment``, if any, an ``id`` (or ``<a name>``) of
that page. Prints each broken link as ``page: link (why)`` and exits 1 when there is any, 0
otherwise; 2 for a folder that holds no page.
"""

from __future__ import annotations

import sys
import urllib.parse
from functools import cache
from html.parser import HTMLParser
from pathlib import Path

__all__ = ["broken_links", "main"]

_LINKING = {"href", "src"}


class _Page(HTMLParser):
    """A page's links and the anchors others may link to."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in _LINKING:
                self.links.append(value)
            elif name == "id" or (tag == "a" and name == "name"):
                self.anchors.add(value)


@cache
def _parsed(page: Path) -> _Page:
    parser = _Page()
    parser.feed(page.read_text(encoding="utf-8"))
    parser.close()
    return parser


def _internal(link: str) -> bool:
    parts = urllib.parse.urlsplit(link)
    return not parts.scheme and not parts.netloc


def broken_links(root: Path) -> list[str]:
    """Every broken internal link of the pages under ``root``, as ``page: link (why)``."""
    root = root.resolve()
    broken: list[str] = []
    for page in sorted(root.rglob("*.html")):
        for link in _parsed(page).links:
            if not _internal(link):
                continue
            parts = urllib.parse.urlsplit(link)
            path = urllib.parse.unquote(parts.path)
            target = (page.parent / path).resolve() if path else page
            shown = f"{page.relative_to(root)}: {link}"
            if not target.is_relative_to(root):
                broken.append(f"{shown} (outside the tree)")
            elif not target.is_file():
                broken.append(f"{shown} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                fragment = urllib.parse.unquote(parts.fragment)
                if fragment not in _parsed(target).anchors:
                    broken.append(f"{shown} (no such anchor)")
    return broken


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_links.py HTML_FOLDER", file=sys.stderr)
        return 2
    root = Path(argv[0])
    pages = sorted(root.rglob("*.html"))
    if not pages:
        print(f"{root} holds no HTML page", file=sys.stderr)
        return 2
    broken = broken_links(root)
    for line in broken:
        print(line)
    print(f"{len(pages)} pages, {len(broken)} broken internal links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
