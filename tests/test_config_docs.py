"""docs/config.md is generated from the config dataclasses; these tests keep it honest."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from ddiloco.cli import build_parser
from ddiloco.commands.options import config_from_args
from ddiloco.settings import config_docs
from ddiloco.settings.config import Config

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REGENERATE = "python -m ddiloco.settings.config_docs > docs/config.md"


def test_config_md_is_current():
    assert DOC.read_text(encoding="utf-8") == config_docs.render(), f"docs/config.md is stale: run `{REGENERATE}`"


def test_module_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "ddiloco.settings.config_docs"], capture_output=True, check=True).stdout
    assert out.decode("utf-8") == config_docs.render()


def test_every_config_field_has_a_description():
    assert config_docs.missing_descriptions() == [], "add an attribute docstring under each of these fields"


def test_every_key_of_every_section_is_documented():
    text = config_docs.render()
    for name, cls in config_docs.sections():
        section = text.split(f"## [{name}]", 1)[1].split("\n## ", 1)[0]
        for f in fields(cls):
            assert f"| `{f.name}` |" in section, f"{name}.{f.name} missing from docs/config.md"
    assert [name for name, _ in config_docs.sections()] == [f.name for f in fields(Config)]


@dataclass
class _Undocumented:
    documented: int = 1
    """Has a description."""
    bare: int = 2
    commented: int = 3  # a comment is not a description


def test_fields_without_a_docstring_are_found():
    docs = config_docs.attribute_docs(_Undocumented)
    assert docs == {"documented": "Has a description."}


def test_render_refuses_a_field_without_a_description(monkeypatch):
    monkeypatch.setattr(config_docs, "sections", lambda: [("run", _Undocumented)])
    with pytest.raises(ValueError, match="run.bare, run.commented"):
        config_docs.render()


def test_flag_column_matches_the_cli():
    """Each flag the reference names sets exactly the key it is listed under."""
    samples = {"--mode": "dp", "--learners": "7", "--seed": "5", "--tokens": "12345", "--time": "77",
               "--mtbf": "33", "--downtime": "11", "--corpus": "/some/dir"}
    assert set(samples) == set(config_docs.FLAGS.values())
    base = config_from_args(build_parser().parse_args(["run"])).to_dict()
    for key, flag in config_docs.FLAGS.items():
        changed = config_from_args(build_parser().parse_args(["run", flag, samples[flag]])).to_dict()
        diff = {f"{s}.{k}" for s in base for k in base[s] if base[s][k] != changed[s][k]}
        if flag == "--time":
            diff.discard("run.tokens")  # a time budget replaces the preset's token budget with 0
        assert diff == {key}, f"{flag} changed {diff}, expected {key}"
