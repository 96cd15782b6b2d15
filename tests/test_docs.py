"""Every ```python block in README.md and docs/*.md runs as written (blocks of one file share a namespace).

Examples that need hardware or packages absent here use another fence (```text, ```bash, ```python-gpu).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("page", [p for p in PAGES if BLOCK.search(p.read_text())], ids=lambda p: p.name)
def test_python_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for index, block in enumerate(BLOCK.findall(page.read_text())):
        exec(compile(block, f"{page.name}[block {index}]", "exec"), namespace)
