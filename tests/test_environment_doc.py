"""docs/environment.md lists exactly the KILN_* variables the code reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_variable_the_code_reads_is_documented() -> None:
    code: set[str] = set()
    for f in (ROOT / "kiln").rglob("*.py"):
        code |= set(re.findall(r"[\"'](KILN_[A-Z0-9_]+)[\"']", f.read_text()))
    doc = set(
        re.findall(r"^\| `(KILN_[A-Z0-9_]+)`", (ROOT / "docs/environment.md").read_text(), re.M)
    )
    assert len(code) > 20
    assert code - doc == set(), "read by kiln/ but not in docs/environment.md"
    assert doc - code == set(), "in docs/environment.md but read nowhere in kiln/"


def test_not_in_key_marks_match_the_tuning_cache() -> None:
    from kiln.build import tuning_cache

    lines = (ROOT / "docs/environment.md").read_text().splitlines()
    marked = {
        m.group(1)
        for line in lines
        if (m := re.match(r"\| `(KILN_[A-Z0-9_]+)` \|", line)) and "*not in the key*" in line
    }
    assert marked == tuning_cache._ENV_NOT_IN_KEY
