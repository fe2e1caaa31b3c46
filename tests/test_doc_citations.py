"""Every document the code cites exists, and so does the section it names: a docstring that
sends the reader to a file the repository does not have (a DESIGN.md, say) is not true."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r'([\w./-]+\.md)\b(?:, "([^"]+)")?')
"""A cited file, and the section it names when the citation reads ``(docs/x.md, "Section")``."""


def citations(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in CITATION.finditer(text)]


def broken(path: Path) -> list[str]:
    """What ``path`` cites that the repository does not have."""
    found = []
    for cited, section in citations(path.read_text(encoding="utf-8")):
        target = next((t for t in (ROOT / cited, ROOT / "docs" / cited) if t.is_file()), None)
        if target is None:
            found.append(f"{path.relative_to(ROOT)} cites {cited}, which does not exist")
        elif section is not None and not re.search(rf"^#+ .*{re.escape(section)}", target.read_text(encoding="utf-8"),
                                                    re.MULTILINE):
            found.append(f"{path.relative_to(ROOT)} cites {cited}, \"{section}\", which has no such section")
    return found


def test_every_document_the_code_cites_exists_with_the_section_it_names():
    sources = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    assert [b for path in sources for b in broken(path)] == []


def test_a_citation_of_a_missing_document_or_section_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real\n\n## Grace window\n")
    code = tmp_path / "m.py"
    code.write_text('"""See DESIGN.md section 2, docs/real.md, "Grace window" and docs/real.md, "Quorum"."""\n')
    assert broken(code) == ['m.py cites DESIGN.md, which does not exist',
                            'm.py cites docs/real.md, "Quorum", which has no such section']


TEST_PATH = re.compile(r"\btests/[\w/]+\.py\b")
"""A test file named by its path from the repository's root (``tests/runtime/sync/test_service.py``)."""


def named_test_files(text: str) -> set[str]:
    return set(TEST_PATH.findall(text))


def test_every_test_file_the_docs_scripts_and_code_name_exists():
    """Tests mirror src/ and move with it: a path to a test that moved or went is found here
    (docs/results/ keeps logs of past runs as they were)."""
    sources = ([ROOT / "README.md", ROOT / "examples" / "README.md", ROOT / ".ci" / "run"]
               + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "scripts").glob("*"))
               + sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
               + sorted((ROOT / "tests").rglob("*.py")))
    missing = [f"{path.relative_to(ROOT)} names {name}" for path in sources if path.is_file()
               for name in sorted(named_test_files(path.read_text(encoding="utf-8"))) if not (ROOT / name).is_file()]
    assert missing == []


def test_a_test_file_named_by_its_path_is_found():
    assert named_test_files("see `tests/runtime/sync/test_service.py::test_x` and tests/conftest.py.") == {
        "tests/runtime/sync/test_service.py", "tests/conftest.py"}
