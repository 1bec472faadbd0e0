"""mkdocs hooks: keep the nav in step with the pages that exist; tidy docstring examples.

mkdocs.yml lists guides in reading order, including some that other work adds later. This hook
drops the entries whose file is not in docs/ (strict mode would fail on them) and adds any guide in
docs/ that mkdocs.yml does not list under "More guides", so a new page never breaks the build and
never goes missing from the site.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _present(entries: list[Any], docs: Path, listed: set[str]) -> list[Any]:
    kept = []
    for entry in entries:
        title, target = next(iter(entry.items())) if isinstance(entry, dict) else (None, entry)
        if isinstance(target, list):
            if children := _present(target, docs, listed):
                kept.append({title: children})
        elif "://" in target or (docs / target).is_file():
            listed.add(target)
            kept.append(entry)
    return kept


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    listed: set[str] = set()
    nav = _present(config["nav"] or [], docs, listed)
    extra = sorted(p.name for p in docs.glob("*.md") if p.name not in listed)
    if extra:
        nav.append({"More guides": extra})
    config["nav"] = nav
    return config


def on_page_content(html: str, **kwargs: Any) -> str:
    """acb's docstrings introduce their example with reST's ``Example::``; on the site the code
    block that follows is enough, so the paragraph ends with one colon."""
    return html.replace("Example::</p>", "Example:</p>")
