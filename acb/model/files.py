"""Files acb keeps between runs: where (``cache_dir``), written whole or not at all
(``save_atomically``), and a converted checkpoint's tokenizer made quick to load
(``name_added_tokens``). Used by the loaders of GGUF files (``loading``, ``gguf_int8``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where converted GGUF checkpoints are kept: ``$ACB_CACHE_DIR``, else ``~/.cache/acb``."""
    return Path(os.environ.get("ACB_CACHE_DIR", Path.home() / ".cache" / "acb"))


def name_added_tokens(folder: Path) -> None:
    """Write the added tokens (``tokenizer.json``'s ``added_tokens``) into the folder's
    ``tokenizer_config.json`` as ``added_tokens_decoder``, as transformers 4 saved them. Without
    it, transformers 5 parses the whole ``tokenizer.json`` in Python at every load to find them
    (SmolLM2's 3.5 MB: ~0.3 s of a ~5 s start) before its Rust tokenizer reads the file again.
    The same tokens, with the same flags, either way."""
    import json

    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in config:
            return
        added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    except (OSError, ValueError, KeyError):  # no such files (not a fast tokenizer): nothing to name
        return
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    tmp = config_path.with_name(f".{config_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, config_path)  # atomic: a reader sees the old file or the new one


def save_atomically(target: Path, write) -> None:
    """Run ``write(folder)`` into a new folder beside ``target``, then rename it into place:
    a reader sees the whole folder or none. If another process finished first, its folder stays."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
