"""The documentation stays true to the code.

- Every ``KUBEON_*`` variable has exactly one row in ``docs/configuration.md``: the settings (derived from
  ``Settings`` as ``ENV`` in ``worker.config`` and, once it exists, ``gateway.settings``), every other
  ``KUBEON_*`` string literal in product code, and every variable the chart sets.
- Every documented ``KUBEON_*`` exists; the page's ``chart`` column says a value exactly where the chart sets one.
- Tables render as tables (no row cut off from its header), and every relative link in README.md and docs/*.md
  points to a file (and heading) that exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import re
import tokenize
from collections import Counter
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
CHART_TEMPLATES = ROOT / "charts"
# Where the product's code lives; test-only variables (tests/, bench/) are out of scope of configuration.md.
PRODUCT_PACKAGES = ("worker", "gateway", "activities", "node", "hub", "tunnel", "models", "workflows", "planning")
SETTINGS_MODULES = ("worker.config", "gateway.settings")
HARNESS_PLACES = ("tests", "bench", "Makefile")

VARIABLE = re.compile(r"\bKUBEON_[A-Z0-9_]+\b")
# KUBEON_* strings in product code that no process reads from its environment.
NOT_VARIABLES = {
    "KUBEON_JOIN": "the heredoc delimiter of the join document in a burst node's user data",
}
NOT_SET_BY_CHART = "—"


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


# -- what exists ---------------------------------------------------------------------------------------------


def _find_spec(name: str) -> object | None:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # the parent package does not exist (yet)
        return None


def settings_variables() -> set[str]:
    """Every setting: the union of the ``ENV`` dicts (field -> variable) of the settings modules there are."""
    names: set[str] = set()
    for module_name in SETTINGS_MODULES:
        if _find_spec(module_name) is None:
            assert module_name != "worker.config", "worker.config must exist"
            continue
        env = importlib.import_module(module_name).ENV
        assert isinstance(env, dict) and env, f"{module_name}.ENV is not a non-empty dict"
        for variable in env.values():
            assert VARIABLE.fullmatch(variable), f"{module_name}.ENV: {variable!r} is not a KUBEON_* name"
        names.update(env.values())
    return names


def _string_literals(path: Path) -> list[str]:
    kinds = {tokenize.STRING}
    if hasattr(tokenize, "FSTRING_MIDDLE"):  # Python 3.12+ splits f-strings
        kinds.add(tokenize.FSTRING_MIDDLE)
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [tok.string for tok in tokens if tok.type in kinds]


def product_variables() -> dict[str, set[str]]:
    """``KUBEON_*`` names in string literals of product code: name -> files."""
    found: dict[str, set[str]] = {}
    for package in PRODUCT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for literal in _string_literals(path):
                for name in VARIABLE.findall(literal):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def chart_variables() -> set[str]:
    """The ``KUBEON_*`` variables the chart's templates set on a container."""
    names: set[str] = set()
    for path in CHART_TEMPLATES.rglob("templates/*"):
        if path.suffix in {".yaml", ".tpl"}:
            names.update(re.findall(r"-\s+name:\s+(KUBEON_[A-Z0-9_]+)\b", path.read_text()))
    return names


def harness_variables() -> set[str]:
    """``KUBEON_*`` names the tests, the harness and the benchmarks use (documented in docs/testing.md)."""
    names: set[str] = set()
    for place in HARNESS_PLACES:
        path = ROOT / place
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and p.suffix in
                                               {".py", ".sh", ".env", ".yaml", ".md"}]
        for file in files:
            if file != Path(__file__).resolve():
                names.update(VARIABLE.findall(file.read_text(errors="replace")))
    return names


def documented_variables() -> set[str]:
    """Everything that may be named in the documentation."""
    product = set(product_variables()) - set(NOT_VARIABLES)
    return settings_variables() | product | chart_variables()


# -- what the documentation says -----------------------------------------------------------------------------


@dataclass
class Table:
    page: str
    line: int
    header: list[str]
    rows: list[tuple[int, list[str]]] = field(default_factory=list)


def _without_code_blocks(text: str) -> list[str]:
    """The page's lines, those inside fenced code blocks blanked (their line numbers kept)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return lines


def _cells(line: str) -> list[str]:
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", inner)]


SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def parse_tables(path: Path, text: str | None = None) -> tuple[list[Table], list[str]]:
    """The tables of a page, and its problems: rows without a header (they render as text), wrong cell counts."""
    lines = _without_code_blocks(path.read_text() if text is None else text)
    page = path.name
    tables: list[Table] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            i += 1
        block = lines[start:i]
        if len(block) < 2 or not SEPARATOR.match(block[1].strip()):
            problems.append(f"{page}:{start + 1}: {len(block)} table row(s) with no header row and separator "
                            "before them: they render as text")
            continue
        table = Table(page, start + 1, _cells(block[0]))
        for offset, line in enumerate(block[2:], start=start + 3):
            cells = _cells(line)
            if len(cells) != len(table.header):
                problems.append(f"{page}:{offset}: {len(cells)} cells, the header has {len(table.header)}")
            table.rows.append((offset, cells))
        tables.append(table)
    return tables, problems


ROW_VARIABLE = re.compile(r"^`(KUBEON_[A-Z0-9_]+)`$")


def configuration_rows(path: Path = CONFIGURATION, text: str | None = None) -> tuple[list[tuple[str, Table,
                                                                                                list[str]]],
                                                                                      list[str]]:
    """Rows documenting one ``KUBEON_*`` variable each: (variable, table, cells); and the problems."""
    assert text is not None or path.is_file(), f"{path.relative_to(ROOT)} is missing: it documents every setting"
    tables, problems = parse_tables(path, text)
    rows = []
    for table in tables:
        for line, cells in table.rows:
            first = cells[0] if cells else ""
            match = ROW_VARIABLE.match(first)
            if match:
                rows.append((match.group(1), table, cells))
            elif VARIABLE.search(first):
                problems.append(f"{path.name}:{line}: {first!r}: one `KUBEON_*` variable per row, alone in the "
                                "first cell")
    return rows, problems


# -- the checks ----------------------------------------------------------------------------------------------


def test_every_setting_is_documented_once() -> None:
    rows, problems = configuration_rows()
    counts = Counter(name for name, _, _ in rows)
    product = product_variables()
    required = {name: "a Settings field" for name in settings_variables()}
    for name, files in product.items():
        if name not in NOT_VARIABLES:
            required.setdefault(name, "read in " + ", ".join(sorted(files)))
    for name in chart_variables():
        required.setdefault(name, "set by the chart")
    page = CONFIGURATION.relative_to(ROOT)
    problems += [f"{name} ({why}) has no row in {page}" for name, why in sorted(required.items()) if not counts[name]]
    problems += [f"{name} has {counts[name]} rows in {page}, not one" for name in sorted(counts) if counts[name] > 1]
    assert not problems, "\n".join(problems)


def test_every_documented_variable_exists() -> None:
    known = documented_variables()
    rows, _ = configuration_rows()
    problems = [f"{CONFIGURATION.relative_to(ROOT)} documents {name}, which no setting, product code or chart has"
                for name, _, _ in rows if name not in known]
    # Elsewhere the harness's own variables may be named too (docs/testing.md).
    anywhere = known | harness_variables()
    for page in markdown_pages():
        for name in sorted(set(VARIABLE.findall(page.read_text())) - anywhere):
            problems.append(f"{page.relative_to(ROOT)} names {name}, which nothing reads or sets")
    assert not problems, "\n".join(problems)


def test_chart_column_says_where_the_chart_sets_a_variable() -> None:
    chart = chart_variables()
    rows, _ = configuration_rows()
    problems = []
    for name, table, cells in rows:
        if "chart" not in table.header:
            problems.append(f"{table.page}:{table.line}: the table documenting {name} has no chart column")
            continue
        says = cells[table.header.index("chart")]
        if name in chart and says == NOT_SET_BY_CHART:
            problems.append(f"{name}: the chart sets it, its chart column says {NOT_SET_BY_CHART}")
        if name not in chart and says != NOT_SET_BY_CHART and not says.startswith(NOT_SET_BY_CHART + " "):
            problems.append(f"{name}: the chart does not set it, its chart column says {says!r}")
    assert not problems, "\n".join(problems)


def test_tables_render() -> None:
    problems = []
    for page in markdown_pages():
        problems += parse_tables(page)[1]
    if CONFIGURATION.is_file():  # a missing page fails test_every_setting_is_documented_once
        problems += configuration_rows()[1]
    assert not problems, "\n".join(sorted(set(problems)))


# -- links -----------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
EXTERNAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose(text: str) -> str:
    """The page without code blocks and code spans, where links are not links."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", "\n".join(_without_code_blocks(text)))


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings (lowercase, punctuation dropped, spaces to hyphens, -N repeats)."""
    anchors: set[str] = set()
    seen: Counter[str] = Counter()
    for line in _without_code_blocks(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def relative_links(page: Path) -> list[str]:
    prose = _prose(page.read_text())
    targets = LINK.findall(prose) + [m.group(1) for m in map(REFERENCE.match, prose.splitlines()) if m]
    return [t for t in targets if not EXTERNAL.match(t)]


def test_relative_links_point_to_files_that_exist() -> None:
    problems = []
    for page in markdown_pages():
        for target in relative_links(page):
            path_part, _, anchor = target.partition("#")
            path_part = path_part.split("?", 1)[0]
            if not path_part:
                resolved = page
            elif path_part.startswith("/"):
                resolved = ROOT / path_part.lstrip("/")
            else:
                resolved = (page.parent / path_part).resolve()
            where = page.relative_to(ROOT)
            if not resolved.exists():
                problems.append(f"{where}: link {target!r}: {path_part} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                problems.append(f"{where}: link {target!r}: {resolved.relative_to(ROOT)} has no heading #{anchor}")
    assert not problems, "\n".join(problems)
