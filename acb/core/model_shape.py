"""The shape of a transformers decoder, read from its config in one place.

A multimodal model's config holds its decoder's settings in a text config
(``get_text_config()``); a config without ``num_key_value_heads`` has as many KV heads
as attention heads, one without ``head_dim`` splits ``hidden_size`` evenly over its
heads. The KV store, the CUDA-graph memory estimate, the sizing and the tensor-parallel
split all read the shape here, so they agree on it. Plain Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


def text_config(config):
    """The decoder's own config: ``config``'s text config, or ``config`` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the KV cache and the memory estimates need to know of a decoder."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> ModelShape:
        """The shape of ``config``'s decoder (a model config, or its text config)."""
        text = text_config(config)
        heads = text.num_attention_heads
        return cls(
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            hidden=text.hidden_size,
            intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
            vocab=text.vocab_size,
        )

    def kv_bytes_per_token(self, dtype) -> int:
        """Bytes of K and V one token takes over every layer, in ``dtype`` (a torch dtype)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype.itemsize
