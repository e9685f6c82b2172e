"""The README and docs are user documentation that stands on its own: every relative link points
at a file (and heading) of this repository, none at a place a user of a fresh clone does not
have; the README stays short; the commands and options they show exist; and no measurement
history (commit hashes, load averages, dates) is left outside docs/benchmarks.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
#: every page written for users or contributors
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "core" / "README.md",
         *sorted(ROOT.glob("plugins/*/README.md")), *sorted((ROOT / "docs").glob("*.md"))]
#: the pages where a measured figure may carry its date and conditions: docs/benchmarks.md only
NO_HISTORY = [p for p in PAGES if p != BENCHMARKS]
#: the Python of core and of the in-repo backends (their docstrings and comments)
SOURCES = sorted(p for d in ("core/src", *(f"plugins/{n}/src" for n in ("cpu", "cuda", "accel")))
                 for p in (ROOT / d).rglob("*.py"))


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _fenced(text: str) -> tuple[str, list[str]]:
    """(the text outside fenced code blocks, the fenced blocks' contents)."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    return re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S), blocks


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lowercased, punctuation dropped, spaces → '-',
    a repeated heading numbered (-1, -2, ...)."""
    prose, _ = _fenced(page.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_links_stay_inside_the_repository(page):
    text = page.read_text()
    assert "DESIGN.md" not in text and "shared folder" not in text and "../shared" not in text
    assert not re.search(r"(?<![\w.])/(?:work|root|home)/", text), \
        "an absolute path of a developer's machine"
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        if re.match(r"[a-z]+://", target):
            continue  # a web page (pluggy's documentation, ...)
        linked = (page.parent / target) if target else page
        assert linked.exists(), f"{page.name} links to {target}, which is missing"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), \
                f"{page.name} links to {target or page.name}#{anchor}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_the_files_the_docs_name_exist(page):
    """A path of this repository the page names (``bench/causal.py``, ``tests/test_ltx2.py``,
    ``plugins/cuda/gpu_check.sh``, ...) is there: a script that moved or went is not quoted."""
    text = page.read_text()
    names = [m.group(1) for m in re.finditer(
        r"(?<![\w./-])((?:bench|tests|scripts|recipes|plugins|core)/[\w./-]*\w)", text)
        if "diffusers'" not in text[max(0, m.start() - 14):m.start()]]  # a path of diffusers' own
    missing = sorted({n for n in names if not (ROOT / n).exists()})
    assert not missing, f"{_ids(page)} names {missing}, which are not in the repository"


def test_the_anchor_rule_is_githubs():
    """The slugs the link check compares against, on headings of the kinds the docs use."""
    page = ROOT / "docs" / "training.md"
    assert {"joint_multi_rl-flow-grpo-over-wan22s-two-experts",
            "beyond-one-machine-torchdistributed-and-ray"} <= _anchors(page)
    models = _anchors(ROOT / "docs" / "models.md")
    assert "a-checkpoints-own-serving-defaults-flowseamjson" in models


def test_the_readme_is_short_and_has_the_two_commands():
    """At most 300 lines; its quick start is the two commands a fresh clone runs, and the test
    command is exactly what CI runs."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300, f"README.md has {len(text.splitlines())} lines"
    _, blocks = _fenced(text)
    commands = [b.strip() for b in blocks]
    assert "scripts/setup-venv && .venv/bin/flowseam demo" in commands
    assert "scripts/test" in commands
    assert "exec scripts/test" in (ROOT / ".ci" / "run").read_text()
    for script in ("scripts/setup-venv", "scripts/test", ".ci/run"):
        assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"


#: measurement history, each a pattern that matches it and nothing a user needs
HISTORY = {
    "a commit hash": re.compile(
        r"(?i)\b(?:commit|main|clone of|checkout of|revision|HEAD)\s*[:@]?\s*`?"
        r"(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
        r"|\((?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\)"),
    "a load average": re.compile(
        r"(?i)\bload average\b|\bload\s+(?:~\s*\d|\d+\.\d|\d+\s*[-–]\s*\d)"),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a time of day": re.compile(r"\b[0-2]\d:[0-5]\d(?::[0-5]\d)?\s*UTC\b"),
}


def _history(text: str) -> list[str]:
    found = []
    for name, pattern in HISTORY.items():
        for m in pattern.finditer(text):
            found.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {name} {m.group(0)!r}")
    return found


def test_the_history_patterns_find_history_and_nothing_else():
    """Each pattern finds what docs/benchmarks.md legitimately holds, and none fires on the
    ordinary text it must leave alone."""
    assert _history("fresh clone of 8421840 on main 2a8a382 (f5d3d38)") and \
        len(_history("fresh clone of 8421840, on main 2a8a382, code (f5d3d38)")) == 3
    for history in ("at load average 3.6", "load 2.8", "load ~12", "load 6–7.4",
                    "2026-12-02", "03:55 UTC"):
        assert _history(history), history
    for ordinary in ("load 2 models, then the main 16 channels", "the commit message",
                     "load the 8-bit weights", "a 32-digit id `video_` + 32 hex digits",
                     "Huang et al. 2025", "frames 4k+1; height/width ÷ 16", "(deadbeef)"):
        assert not _history(ordinary), ordinary
    benchmarks = BENCHMARKS.read_text()
    assert {name for name, p in HISTORY.items() if p.search(benchmarks)} >= \
        {"a load average", "a date"}


@pytest.mark.parametrize("page", NO_HISTORY, ids=_ids)
def test_no_measurement_history_in_the_docs(page):
    """Figures with their dates and conditions belong in docs/benchmarks.md, with their command."""
    assert not _history(page.read_text()), f"{_ids(page)}: {_history(page.read_text())}"


def test_no_measurement_history_in_docstrings():
    found = {_ids(p): h for p in SOURCES if (h := _history(p.read_text()))}
    assert not found, f"measurement history in the source: {found}"


def test_every_benchmark_row_has_its_command():
    """docs/benchmarks.md: in every table, one row per figure and a command column that says
    how to reproduce it."""
    rows = 0
    for table in re.findall(r"((?:^\|.*\|\n)+)", BENCHMARKS.read_text(), flags=re.M):
        lines = table.splitlines()
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        assert header[-1] == "command", f"a table whose last column is not the command: {header}"
        for line in lines[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert len(cells) == len(header), line
            assert "`" in cells[-1] or cells[-1].startswith(("same", "(")), line
            rows += 1
    assert rows > 50


#: a command line running flowseam: at the start of a line or inline code span (after a prompt,
#: variable assignments, ``time`` and a path such as ``.venv/bin/``), or after ``-m``
COMMAND_LINE = re.compile(r"(?:^[ \t]*(?:\$[ \t]+)?(?:\w+=\S*[ \t]+)*(?:time[ \t]+)?(?:\S*/)?"
                          r"|-m[ \t]+)flowseam[ \t]+([a-z][\w-]*|--?[\w-]+)([^#|;>&\n]*)",
                          flags=re.M)


def _documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, options) of every ``flowseam COMMAND --option ...`` the docs show, in code
    blocks and inline code; a comment, pipe or redirection ends the command line."""
    found = []
    for page in PAGES:
        prose, blocks = _fenced(page.read_text())
        spans = [*re.findall(r"`([^`\n]+)`", prose),
                 *(line for b in blocks for line in b.replace("\\\n", " ").splitlines())]
        for span in spans:
            for m in COMMAND_LINE.finditer(span):
                command, rest = m.group(1), m.group(2)
                if command.startswith("-"):
                    command, rest = "", f"{command} {rest}"
                options = re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest)
                found.append((_ids(page), command, options))
    return found


def test_the_documented_commands_and_options_exist():
    """Every ``flowseam COMMAND`` in the README and docs is a command of the installed CLI, and
    every option shown with it is in that command's ``--help``."""
    documented = _documented_commands()
    assert len(documented) > 40
    assert any(cmd == "generate" and "--lora" in opts for _, cmd, opts in documented)
    helps: dict[str, str] = {}
    for page, command, options in documented:
        if command not in helps:
            result = run_main(*([command] if command else []), "--help")
            assert result.returncode == 0, f"{page}: `flowseam {command}` is not a command"
            helps[command] = result.stdout
        missing = [o for o in options if o not in ("-h", "--help") and
                   not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", helps[command])]
        assert not missing, f"{page}: `flowseam {command}` has no option {missing}"


def test_the_architecture_page_names_every_core_module():
    """docs/architecture.md is the map of the code: each top-level module and package of core
    is named there."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    core = ROOT / "core" / "src" / "flowseam"
    names = sorted(p.stem for p in core.iterdir()
                   if (p.suffix == ".py" and not p.name.startswith("_")) or
                   (p.is_dir() and (p / "__init__.py").is_file()))
    missing = [n for n in names if f"flowseam/{n}" not in text and f"flowseam.{n}" not in text
               and f"  {n}.py " not in text and f"  {n}/ " not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_config_key_of_flowseams_methods_is_explained():
    """``--show-config`` prints every key of a method's config; docs/training.md says what each
    means (a key, a table, or a table's key named in code there)."""
    from flowseam.training import registered_methods

    page = re.sub(r"```.*?```", "", (ROOT / "docs" / "training.md").read_text(), flags=re.S)
    code = " ".join(re.findall(r"`([^`]+)`", page))
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
    missing = {}
    for name, method in registered_methods().items():
        if not method.__module__.startswith("flowseam."):
            continue
        config = method.default_config()
        keys = [k for k in config] + [sub for k in method.config_tables
                                      for sub in (config.get(k) or {})]
        missing[name] = sorted(k for k in keys if k not in named)
    assert {k: v for k, v in missing.items() if v} == {}
