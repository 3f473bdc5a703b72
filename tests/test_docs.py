"""Docs that cannot go stale: the design's sections that the code cites exist, every repository path (and test
id) that README.md and docs/*.md cite is there, and every command of the README's tables answers --help."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("hpcrl/", "docs/", "tests/", "scripts/", "configs/", "examples/", "bench/", "sbatch/", "ckpt_tools/", ".ci/")
CITATION = re.compile(r"design\.md\s+§(\d+(?:\.\d+)?)")


def design_sections() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    return {m.group(1) for m in re.finditer(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M)}


def sources() -> list[Path]:
    files = [p for d in ("hpcrl", "ckpt_tools", "scripts", "sbatch", "tests", "docs")
             for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    return [*files, ROOT / "README.md"]


def test_every_design_section_the_code_cites_exists() -> None:
    sections = design_sections()
    assert {"3.2", "3.3", "3.4", "4.7", "4.8", "4.10"} <= sections
    cited = {}
    for path in sources():
        text = path.read_text(errors="replace")
        assert not re.search(r"\bDESIGN\b(?!\.md)", text) or path.name == "test_docs.py", \
            f"{path.relative_to(ROOT)} cites DESIGN: cite docs/design.md as 'design.md §N.M'"
        for m in CITATION.finditer(text):
            cited.setdefault(m.group(1), []).append(str(path.relative_to(ROOT)))
    assert len(cited) >= 6, cited  # the code does cite the design
    missing = {s: where for s, where in cited.items() if s not in sections}
    assert not missing, f"cited sections that docs/design.md does not have: {missing}"


def cited_paths(doc: Path) -> set[str]:
    """Repository paths in backticks, and relative link targets, of one markdown file."""
    text = doc.read_text()
    out = set()
    for m in re.finditer(r"`([^`\s]+)`", text):
        token = re.sub(r":\d+(-\d+)?$", "", m.group(1).split("#")[0].rstrip(".,:;)"))
        if token.startswith(TOP) and not any(c in token for c in "*<>{}$|"):
            out.add(token)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1).split("#")[0]
        if target and not target.startswith(("http://", "https://", "mailto:")):
            out.add(str((doc.parent / target).resolve().relative_to(ROOT)))
    return out


def test_every_path_the_docs_cite_exists() -> None:
    missing = []
    for doc in DOCS:
        for cited in sorted(cited_paths(doc)):
            path, _, test = cited.partition("::")
            if not (ROOT / path).exists():
                missing.append(f"{doc.name}: {cited}")
            elif test and not re.search(rf"^def {re.escape(test.split('[')[0])}\(", (ROOT / path).read_text(), re.M):
                missing.append(f"{doc.name}: {cited} (no such test)")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def readme_table_commands() -> list[list[str]]:
    """The ``python -m ...`` and ``python scripts/...`` commands of the README's tables, as argv up to the
    module or script."""
    found = set()
    for line in (ROOT / "README.md").read_text().splitlines():
        if not line.startswith("|"):
            continue
        for m in re.finditer(r"`python (-m [\w.]+|scripts/[\w./]+\.py)", line):
            found.add(m.group(1))
    return [cmd.split() for cmd in sorted(found)]


def test_every_command_of_the_readme_tables_answers_help() -> None:
    import os
    import subprocess
    import sys

    commands = readme_table_commands()
    assert ["-m", "hpcrl.submit"] in commands and len(commands) >= 8, commands
    failed = []
    for argv in commands:
        out = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        if out.returncode != 0 or "usage:" not in out.stdout:
            failed.append(f"{' '.join(argv)} --help: exit {out.returncode}: {(out.stderr or out.stdout)[-300:]}")
    assert not failed, "\n".join(failed)


def measured_rows() -> list[list[str]]:
    """The cells of each row of the README's table of measurements on the CPU machine."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Measured on this 2-core CPU machine", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in table.splitlines() if line.startswith("| ")]
    return rows[1:]  # the header


def test_every_measured_row_names_the_file_that_holds_its_numbers() -> None:
    """A number in the README comes from a file in bench/ that a script wrote (its path checked by the test
    above), or from a test that asserts it (the row's command is a pytest)."""
    rows = measured_rows()
    assert len(rows) >= 15, rows
    unbacked = [row[0][:60] for row in rows
                if not re.search(r"`bench/[\w./-]+`", row[1]) and not row[-1].startswith("`pytest ")]
    assert not unbacked, "rows whose numbers no bench/ file holds:\n" + "\n".join(unbacked)
