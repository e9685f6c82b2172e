"""The README and docs stand on their own: every relative link points at a file of this
repository, none points at a place a user of a fresh clone does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository(page):
    text = page.read_text()
    assert "DESIGN.md" not in text and "shared folder" not in text
    assert not re.search(r"(?<![\w.])/work/", text), "an absolute path of a developer's machine"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue  # a web page (pluggy's documentation, ...)
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which is missing"


def test_the_architecture_page_names_every_core_module():
    """docs/architecture.md is the map of the code: each top-level module and package of core
    is named there."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    core = ROOT / "core" / "src" / "flowseam"
    names = sorted(p.stem for p in core.iterdir()
                   if (p.suffix == ".py" and not p.name.startswith("_")) or
                   (p.is_dir() and (p / "__init__.py").is_file()))
    missing = [n for n in names if f"flowseam/{n}" not in text and f"flowseam.{n}" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
