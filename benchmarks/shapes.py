"""The model shapes the benchmarks run: SmolLM2-135M (the real model, its GGUF file) or a popular
model's shape with random weights (``--shape qwen2.5-0.5b``), built once from its config by
transformers and kept under ``$ACB_CACHE_DIR/shapes`` (default ``~/.cache/acb/shapes``) with SmolLM2's
tokenizer (the workloads are SmolLM2 token ids; every vocabulary here is larger). EOS is ignored by
every workload, so random weights time the same work as trained ones. Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

# hidden, layers, query heads, KV heads, MLP width, vocabulary, head dim, tied embedding, architecture
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1e6),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1e6),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1e6),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=5e5),
}


def checkpoint(shape: str = "smollm2") -> tuple[str, str | None]:
    """(folder, gguf_file or None) of ``shape``: SmolLM2's own file, or the shape's random-weight
    folder (made on first use: float32 safetensors, ~4 bytes a parameter)."""
    from acb.model.loading import _converted_gguf, smollm2

    if shape == "smollm2":
        return smollm2()
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from smollm2, {', '.join(SHAPES)}")
    from acb.model.files import cache_dir, save_atomically

    target = cache_dir() / "shapes" / shape
    if not (target / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        spec = dict(SHAPES[shape])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec, max_position_embeddings=32768,
                                      torch_dtype="float32")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(_converted_gguf(*smollm2())))

        def write(folder: Path) -> None:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)

        save_atomically(target, write)
    return str(target), None


def model_dir(shape: str = "smollm2") -> str:
    """A plain Hugging Face folder of ``shape`` (SmolLM2's GGUF file dequantized), for peers that
    cannot read GGUF."""
    from acb.model.loading import _converted_gguf

    folder, gguf_file = checkpoint(shape)
    return str(_converted_gguf(folder, gguf_file)) if gguf_file else folder


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or list(SHAPES):
        print(name, checkpoint(name), os.path.getsize(os.path.join(checkpoint(name)[0], "config.json")))
