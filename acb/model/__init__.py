"""The model side: acb's fused CPU forward (``fused``, with LoRA in ``fused_lora``/``lora``),
weight quantization (``quantization``, GGUF to int8 in ``gguf_int8``), loading files and caches
(``loading``), and the watch that notices a model changed under the fast paths (``watch``)."""
