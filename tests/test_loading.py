"""acb.model.loading's own parts that need no real model: the converted folder's tokenizer config."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer

from acb.model.files import name_added_tokens
from acb.testing import tiny_tokenizer


def test_a_converted_tokenizer_names_its_added_tokens_and_loads_the_same(tmp_path, monkeypatch):
    """acb writes the added tokens into a converted folder's tokenizer_config.json, where
    transformers 5 otherwise parses the whole tokenizer.json in Python at every load to find
    them: the tokenizer loaded either way is the same."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    tok.add_tokens(["hello world"])
    plain, named = tmp_path / "plain", tmp_path / "named"
    tok.save_pretrained(plain)
    shutil.copytree(plain, named)
    name_added_tokens(named)
    config = json.loads((named / "tokenizer_config.json").read_text())
    added = json.loads((named / "tokenizer.json").read_text())["added_tokens"]
    assert {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()} == \
        {t["id"]: t["content"] for t in added}
    before = (named / "tokenizer_config.json").read_bytes()
    name_added_tokens(named)  # a second time: nothing to do
    assert (named / "tokenizer_config.json").read_bytes() == before

    parsed = []
    load = json.load
    monkeypatch.setattr(json, "load", lambda f, *a, **k: parsed.append(getattr(f, "name", "")) or load(f, *a, **k))
    fast = AutoTokenizer.from_pretrained(named)
    assert not [p for p in parsed if p.endswith("tokenizer.json")]  # the Rust tokenizer reads it, once
    monkeypatch.undo()
    slow = AutoTokenizer.from_pretrained(plain)

    def tokens(t):
        return {i: (str(a), a.special, a.normalized, a.lstrip, a.rstrip, a.single_word)
                for i, a in t.added_tokens_decoder.items()}

    assert tokens(fast) == tokens(slow)
    assert fast.special_tokens_map == slow.special_tokens_map
    for text in ("<s>hello world<tool> ünï </s>", "plain text"):
        assert fast(text)["input_ids"] == slow(text)["input_ids"]
        assert fast.decode(fast(text)["input_ids"], skip_special_tokens=True) == \
            slow.decode(slow(text)["input_ids"], skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    assert fast.apply_chat_template(messages, tokenize=False) == slow.apply_chat_template(messages, tokenize=False)


def test_naming_added_tokens_leaves_a_folder_without_a_fast_tokenizer_alone(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    name_added_tokens(tmp_path)
    assert (tmp_path / "tokenizer_config.json").read_text() == "{}"
    name_added_tokens(tmp_path / "missing")  # no folder at all: nothing raised


def test_loaded_weights_are_the_processs_own_not_views_of_the_file(tmp_path):
    """A float32 checkpoint loaded as float32 comes back as views of the mapped safetensors
    file: acb copies those out (the file's pages would stay mapped and counted otherwise); a
    cast load's weights are already copies and are not copied again."""
    import torch

    from acb.model.loading import _mapped_files, load
    from acb.testing import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    for dtype in ("float32", "bfloat16"):
        model, _ = load(tmp_path, dtype=dtype, device="cpu")
        assert next(model.parameters()).dtype == getattr(torch, dtype)
        mapped = _mapped_files()
        assert mapped is not None  # Linux: /proc/self/maps
        assert not [n for n, p in model.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in mapped)]
