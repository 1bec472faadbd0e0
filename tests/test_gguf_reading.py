"""acb.model.gguf_reading: a GGUF file's header parsed once per load, over a plain ndarray view
of its map, and the ``gguf`` module's own names given back afterwards."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from acb.model import gguf_reading  # noqa: E402


def _small_file(path) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_scores([float(i) for i in range(300)])
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("token_embd.weight", np.ones((300, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture
def parses(monkeypatch) -> list:
    """The paths the plain reader parses, one entry a parse."""
    seen = []
    cls = gguf_reading._plain_reader_class()
    init = cls.__init__
    monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: (seen.append(a), init(self, *a, **k))[1])
    return seen


def test_the_plain_reader_reads_what_gguf_reads(tmp_path):
    path = _small_file(tmp_path / "small.gguf")
    stock, plain = gguf.gguf_reader.GGUFReader(path), gguf_reading.reader(path)
    assert type(plain.data) is np.ndarray and type(stock.data) is np.memmap  # (the reason it is faster)
    assert list(stock.fields) == list(plain.fields)
    for name, field in stock.fields.items():
        other = plain.fields[name]
        assert (field.types, field.data, field.offset) == (other.types, other.data, other.offset), name
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, other.parts, strict=True)), name
    for a, b in zip(stock.tensors, plain.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert np.array_equal(a.data, b.data)


def test_a_file_is_parsed_once_while_a_load_runs_and_gguf_is_given_back(tmp_path, parses):
    path = _small_file(tmp_path / "small.gguf")
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_reading.parsed_once():
        first = gguf.GGUFReader(path)  # as transformers calls it (``from gguf import GGUFReader``)
        with gguf_reading.parsed_once():  # a load inside a load: still the one reader
            assert gguf.GGUFReader(str(tmp_path / "." / "small.gguf")) is first
        assert gguf_reading.reader(path) is first
        assert gguf.get_tensor_name_map is not original_map
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)  # one table, not one a module
        assert gguf.get_tensor_name_map(arch, 2).get_name("model.layers.0.self_attn.q_proj") == "blk.0.attn_q"
        writable = gguf.GGUFReader(path, "r+")  # not read-only: the stock reader, its own
        assert type(writable) is original_reader and writable is not first
    assert len(parses) == 1
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (original_reader, original_map)
    assert gguf_reading._readers == {}  # the parsed header is not kept after the load
    assert gguf_reading.reader(path) is not first  # outside a load: a reader of its own


def test_transformers_reads_the_config_and_tokenizer_from_one_parse(parses):
    """What a first GGUF load asks of the header (its config and tokenizer through transformers,
    acb's own reader): one parse of SmolLM2's file."""
    from transformers import AutoConfig, AutoTokenizer

    from acb.model.loading import smollm2

    try:
        folder, name = smollm2()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with gguf_reading.parsed_once():
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        reader = gguf_reading.reader(f"{folder}/{name}")
    assert len(parses) == 1
    assert config.num_hidden_layers == 30 and len(tokenizer) >= 49152
    assert len(reader.tensors) == 272


def test_without_the_gguf_package_a_load_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"acb\[gguf\]"):
        with gguf_reading.parsed_once():
            pass
