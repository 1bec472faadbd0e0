"""docs/hooks/nav.py: the site's nav lists the guides that exist, in mkdocs.yml's order, plus any
guide mkdocs.yml does not list yet."""

from __future__ import annotations

import importlib.util
from pathlib import Path

HOOK = Path(__file__).resolve().parent.parent / "docs" / "hooks" / "nav.py"
spec = importlib.util.spec_from_file_location("docs_nav_hook", HOOK)
nav_hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nav_hook)


def test_nav_drops_pages_not_written_yet_and_adds_unlisted_guides(tmp_path):
    for name in ("index.md", "streaming.md", "new-guide.md", "reference/engine.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("# page\n")
    config = {"docs_dir": str(tmp_path), "nav": [
        {"Home": "index.md"},
        {"Guides": [{"Streaming": "streaming.md"}, {"Starlette": "starlette.md"}]},
        {"Planned": [{"Later": "later.md"}]},
        {"API reference": [{"Engine": "reference/engine.md"}]},
        {"Source": "https://example.org/acb"},
    ]}
    assert nav_hook.on_config(config)["nav"] == [
        {"Home": "index.md"},
        {"Guides": [{"Streaming": "streaming.md"}]},
        {"API reference": [{"Engine": "reference/engine.md"}]},
        {"Source": "https://example.org/acb"},
        {"More guides": ["new-guide.md"]},
    ]


def test_rendered_examples_end_with_one_colon():
    assert nav_hook.on_page_content("<p>Example::</p><pre>x</pre>") == "<p>Example:</p><pre>x</pre>"
