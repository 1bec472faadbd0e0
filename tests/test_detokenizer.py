"""Incremental detokenization and stop strings."""

from __future__ import annotations

from acb.core.detokenizer import Detokenizer, StopMatcher
from acb.testing import tiny_tokenizer


def _stream(tok, ids, step=1):
    d = Detokenizer(tok)
    parts = [d.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    parts.append(d.flush())
    return parts


def test_never_splits_a_utf8_character():
    tok = tiny_tokenizer()
    text = "héllo 日本語 🙂 ok"
    ids = tok(text)["input_ids"]
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    parts = _stream(tok, ids)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)


def test_merged_pushes_give_the_same_text():
    tok = tiny_tokenizer()
    ids = tok("añb€c 🙂")["input_ids"]
    assert "".join(_stream(tok, ids, step=3)) == "añb€c 🙂"


def test_incomplete_character_at_the_end_is_flushed():
    tok = tiny_tokenizer()
    ids = tok("a🙂")["input_ids"][:-1]  # cut inside the emoji
    parts = _stream(tok, ids)
    assert parts[-1] != "" and "".join(parts) == tok.decode(ids)


def test_sentencepiece_spaces_are_kept():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁how": 4, "▁are": 5, "▁you": 6}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    ids = [1, 2, 3, 4, 5, 6]
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "Hello world! how are you"


def test_stop_string_across_chunk_boundaries():
    m = StopMatcher(["STOP"])
    out = []
    for piece in ["abc S", "T", "O", "Pxyz"]:
        text, matched = m.push(piece)
        out.append(text)
        if matched:
            break
    assert matched and "".join(out) == "abc "


def test_held_back_prefix_is_released_when_it_stops_matching():
    m = StopMatcher(["</end>"])
    assert m.push("a</e") == ("a", False)
    assert m.push("x") == ("</ex", False)
    assert m.push("</en") == ("", False)
    assert m.flush() == "</en"


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == ("hel", True)
