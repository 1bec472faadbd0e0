"""Test your own async app against a real acb engine in milliseconds.

Everything here is built in-process, with no download: a byte-level tokenizer
(any UTF-8 text round-trips), tiny random decoder models of several
architectures, and an engine factory. With acb installed, pytest picks up the
fixtures in :mod:`acb.testing.pytest_plugin` automatically.

Example::

    from acb.testing import tiny_engine

    async def test_my_handler():
        async with tiny_engine() as engine:
            text = (await engine.generate("hello", max_new_tokens=8)).text
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..core.config import EngineConfig
from ..core.sampling_params import SamplingParams
from ..engine.engine import Engine
from .inspection import StepCounts, runner_of, speculate_always, step_counts

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 3 + 256  # the specials, then one token per byte
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@functools.cache
def _byte_level_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet, key=lambda c: ord(c)):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


def tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per UTF-8 byte, so
    multi-byte characters span several tokens. ids 0/1/2 are pad/bos/eos."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_byte_level_tokenizer_json()),
        bos_token="<s>", eos_token="</s>", pad_token="<pad>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")


def tiny_config(arch: str = "llama", **overrides: Any):
    """A small config of ``arch`` whose random weights give varied greedy output."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=0.2, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=8)
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(**common, sliding_window=8, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0, query_pre_attn_scalar=16)
    elif arch == "gemma3":
        common["num_hidden_layers"] = 3
        cfg = tf.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@functools.cache
def _tiny_state(arch: str, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return cfg, {k: v.clone() for k, v in model.state_dict().items()}


def tiny_model(arch: str = "llama", seed: int = 0, device: str | None = None) -> torch.nn.Module:
    """A fresh tiny random model (same weights for the same ``arch`` and ``seed``), on
    ``device`` (default: $ACB_TEST_DEVICE, else the CPU)."""
    from transformers import AutoModelForCausalLM

    cfg, state = _tiny_state(arch, seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.float32)
    model.load_state_dict(state)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model.to(device or os.environ.get("ACB_TEST_DEVICE", "cpu")).eval()


def tiny_engine(arch: str = "llama", *, seed: int = 0, config: EngineConfig | None = None,
                sampling: SamplingParams | None = None, **config_fields: Any) -> Engine:
    """An engine over a tiny model and the byte-level tokenizer. Use it as
    ``async with tiny_engine() as engine: ...``. Keyword arguments are EngineConfig fields;
    ``debug_checks`` is on unless they turn it off (the page accounting is checked whenever the
    engine goes idle: a leak fails the test that caused it)."""
    if config is None:
        config_fields.setdefault("num_blocks", 256)
        config_fields.setdefault("page_size", 8)
        config_fields.setdefault("debug_checks", True)
        config = EngineConfig(**config_fields)
    elif config_fields:
        raise TypeError("pass either config= or EngineConfig fields, not both")
    return Engine(tiny_model(arch, seed), tokenizer=tiny_tokenizer(), config=config, sampling=sampling)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random byte tokens, ``lo``..``hi`` tokens long (reproducible)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int,
                     eos: bool = False, **generate_kwargs: Any) -> list[int]:
    """transformers' own ``generate`` (greedy) on a private copy of ``model``: the
    reference acb must equal token for token. ``generate_kwargs`` go to ``generate``
    (e.g. ``repetition_penalty=1.3``)."""
    ref = _reference_copy(model)
    ids = torch.tensor([prompt_ids], device=next(ref.parameters()).device)
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0)
    if not eos:
        kwargs.update(eos_token_id=None, min_new_tokens=max_new_tokens)
    kwargs.update(generate_kwargs)
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt_ids):].tolist()


def reference_log_softmax(model: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' own forward over ``prompt_ids`` (a private copy of ``model``), as
    float32 log-probabilities [len(prompt_ids), vocab]: row ``p`` scores the token after
    position ``p``. The reference of ``prompt_logprobs``."""
    ref = _reference_copy(model)
    ids = torch.tensor([prompt_ids], device=next(ref.parameters()).device)
    with torch.inference_mode():
        logits = ref(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def reference_embedding(model: torch.nn.Module, prompt_ids: list[int], pooling: str = "last",
                        normalize: bool = True) -> torch.Tensor:
    """transformers' own base model over ``prompt_ids`` (a private copy of ``model``): its
    ``last_hidden_state`` (after the final norm) pooled as ``Engine.embed`` pools (``last``,
    ``mean``, ``cls``), float32 [hidden]. The reference of embeddings."""
    ref = _reference_copy(model)
    ids = torch.tensor([prompt_ids], device=next(ref.parameters()).device)
    with torch.inference_mode():
        states = getattr(ref, ref.base_model_prefix)(ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
    states = states.float().cpu()
    v = {"last": states[-1], "mean": states.mean(dim=0), "cls": states[0]}[pooling]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_lora_model(arch: str = "llama", seed: int = 0, r: int = 4, alpha: float = 8,
                    targets: Sequence[str] = LORA_TARGETS, **lora_config: Any) -> torch.nn.Module:
    """PEFT's LoRA model over a fresh tiny ``arch`` model (needs ``peft``), its A and B weights
    random and non-zero so that the adapter changes the greedy output: what
    ``Engine.load_adapter`` takes (or, saved with ``save_pretrained``, a PEFT folder), and the
    reference for ``reference_greedy`` with that adapter active. ``lora_config``: more
    ``peft.LoraConfig`` fields (``use_rslora=True``, ...)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        # peft (0.21) reads transformers' deprecated `is_gradient_checkpointing` (5.x: FutureWarning)
        # inside get_peft_model; nothing acb passes avoids it
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = get_peft_model(tiny_model(arch), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                            lora_dropout=0.0, **lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = getattr(model, "_acb_reference", None)
    if ref is None:
        from ..kernels import cpu_linear

        memo = cpu_linear.deepcopy_memo(model)  # an engine holds the model, packed
        ref = copy.deepcopy(model, memo=memo)
        if memo:
            ref.__dict__.pop(cpu_linear.ATTR, None)
            for module in ref.modules():
                if module.__dict__.get("forward", 0) is None:
                    del module.forward
        impl = "eager" if getattr(ref.config, "attn_logit_softcapping", None) else "sdpa"
        ref.config._attn_implementation = impl
        object.__setattr__(model, "_acb_reference", ref)
    return ref


__all__ = [
    "ARCHITECTURES", "BOS_ID", "EOS_ID", "LORA_TARGETS", "PAD_ID", "VOCAB_SIZE", "StepCounts", "random_prompts",
    "reference_embedding", "reference_greedy", "reference_log_softmax", "tiny_lora_model",
    "runner_of", "speculate_always", "step_counts", "tiny_config", "tiny_engine", "tiny_model", "tiny_tokenizer",
]
