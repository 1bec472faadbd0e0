"""LoRA adapters: a step mixing rows of two adapters and of the base model gives, per
row, the greedy tokens of PEFT's own model with that adapter active under transformers'
``generate``; bad adapters are refused by name and the engine serves on; adapters load
and unload while requests stream; the prefix cache never serves one adapter's pages to
another."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import acb
from acb.core.errors import InvalidRequestError
from acb.model.fused import native_bf16
from acb.testing import (
    ARCHITECTURES,
    LORA_TARGETS,
    random_prompts,
    reference_greedy,
    runner_of,
    tiny_lora_model,
    tiny_model,
    tiny_tokenizer,
)


def config(**fields):
    fields.setdefault("num_blocks", 256)
    fields.setdefault("page_size", 8)
    return acb.EngineConfig(**fields)


def native_kernels() -> bool:
    """Whether float32 adapters run on acb/kernels/csrc/lora_cpu.cpp here (an AVX-512 CPU)."""
    from acb.kernels.cpu import lora_kernels

    kernels = lora_kernels()
    return kernels is not None and kernels.available()


async def _mixed_batch(arch, tmp_path, monkeypatch=None, native=True):
    a = tiny_lora_model(arch, seed=1, r=4)
    b = tiny_lora_model(arch, seed=2, r=8, alpha=16, use_rslora=True)
    a.save_pretrained(tmp_path / "a")
    prompts = random_prompts(6, 4, 20, seed=5)
    names = [None, "a", "b", "a", None, "b"]
    models = {None: tiny_model(arch), "a": a, "b": b}
    expected = [reference_greedy(models[n], p, 10) for n, p in zip(names, prompts)]
    base_out = [reference_greedy(models[None], p, 10) for p in prompts]
    assert all(e != o for e, o, n in zip(expected, base_out, names) if n), "an adapter did not change the output"
    engine = acb.Engine(tiny_model(arch), config=config(max_adapters=2, max_adapter_rank=8))
    async with engine:
        await engine.load_adapter(tmp_path / "a", "a")  # a PEFT folder
        await engine.load_adapter(b, "b")  # a peft model
        assert engine.adapters() == ["a", "b"]
        bank = runner_of(engine).lora
        if not native:
            bank.kernels = None  # the fused forward's PyTorch path (what bfloat16 runs)
        assert (bank.kernels is not None) == (native and native_kernels())
        results = await asyncio.gather(*(engine.generate(p, adapter=n, max_new_tokens=10, ignore_eos=True,
                                                         temperature=0) for p, n in zip(prompts, names)))
        path = runner_of(engine).forward_path
    for got, want, n in zip(results, expected, names):
        assert got.token_ids == want, f"adapter {n!r} diverged from PEFT's generate"
    return path


# llama and a hybrid (gemma3) in the default run, the other architectures in CI's extras step
@pytest.mark.parametrize("arch", [a if a in ("llama", "gemma3") else pytest.param(a, marks=pytest.mark.extras)
                                  for a in ARCHITECTURES])
async def test_mixed_adapters_match_peft_generate(arch, tmp_path):
    path = await _mixed_batch(arch, tmp_path)
    assert path == "fused"  # float32 on the CPU: the fused forward adds the deltas


async def test_mixed_adapters_without_the_native_kernels(tmp_path):
    assert await _mixed_batch("llama", tmp_path, native=False) == "fused"


@pytest.mark.parametrize("native", [True, False])
async def test_one_adapter_on_every_row(native):
    """Every row on one adapter (prompt chunks and decode rows, side by side): one run of rows,
    no gather, on the native kernels and on the PyTorch path."""
    a = tiny_lora_model("llama", seed=4, r=8, alpha=16)
    prompts = random_prompts(5, 3, 40, seed=29)
    async with acb.Engine(tiny_model("llama"), config=config(max_adapters=2, max_adapter_rank=8)) as engine:
        await engine.load_adapter(a, "a")
        if not native:
            runner_of(engine).lora.kernels = None
        results = await asyncio.gather(*(engine.generate(p, adapter="a", max_new_tokens=8, ignore_eos=True)
                                         for p in prompts))
    assert [r.token_ids for r in results] == [reference_greedy(a, p, 8) for p in prompts]


async def test_mixed_adapters_under_transformers_forward(tmp_path, monkeypatch):
    monkeypatch.setenv("ACB_CPU_FUSED", "0")  # transformers' forward: the LoRA hooks add the deltas
    assert await _mixed_batch("qwen3", tmp_path) == "transformers"


async def test_unknown_adapter_is_refused_by_name():
    async with acb.Engine(tiny_model("llama"), config=config()) as engine:
        with pytest.raises(InvalidRequestError, match="'nope' is not loaded") as e:
            await engine.generate([5, 6, 7], adapter="nope", max_new_tokens=2)
        assert e.value.param == "adapter"
        with pytest.raises(InvalidRequestError):
            engine.submit([5, 6, 7], sampling=acb.SamplingParams(adapter=""))
        assert len((await engine.generate([5, 6, 7], max_new_tokens=2)).token_ids) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(use_dora=True), "DoRA"),
    (dict(bias="lora_only"), "bias='lora_only'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(targets=["q_proj", "lm_head"]), "lm_head"),
])
async def test_unsupported_peft_features_are_refused(kwargs, match):
    source = tiny_lora_model("llama", seed=3, **kwargs)
    async with acb.Engine(tiny_model("llama"), config=config()) as engine:
        with pytest.raises(InvalidRequestError, match=match):
            await engine.load_adapter(source, "x")
        assert engine.adapters() == []
        await engine.load_adapter(tiny_lora_model("llama", seed=3), "x")  # the slot was given back
        assert len((await engine.generate([5, 6, 7], adapter="x", max_new_tokens=2)).token_ids) == 2


async def test_bad_shapes_rank_and_slots_are_refused():
    other = tiny_lora_model("llama", seed=4)
    cfg, state = other.peft_config["default"], {k: v for k, v in _state(other).items()}
    key = next(k for k in state if "q_proj.lora_A" in k)
    bad = dict(state, **{key: torch.zeros(4, 32)})
    async with acb.Engine(tiny_model("llama"), config=config(max_adapters=1, max_adapter_rank=4)) as engine:
        with pytest.raises(InvalidRequestError, match=r"q_proj: lora_A \[4, 32\]"):
            await engine.load_adapter((cfg, bad), "bad")
        with pytest.raises(InvalidRequestError, match="max_adapter_rank=4") as e:
            await engine.load_adapter(tiny_lora_model("llama", seed=4, r=8), "big")
        assert e.value.param == "max_adapter_rank"
        await engine.load_adapter((cfg, state), "one")
        with pytest.raises(InvalidRequestError, match="max_adapters"):
            await engine.load_adapter((cfg, state), "two")
        with pytest.raises(InvalidRequestError, match="already loaded"):
            await engine.load_adapter((cfg, state), "one")
        assert engine.adapters() == ["one"]


def _state(model):
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


async def test_settings_that_cannot_run_adapters_are_named():
    with pytest.raises(ValueError, match="max_adapter_rank"):
        acb.EngineConfig(max_adapter_rank=0)
    with pytest.raises(ValueError, match="max_adapters"):
        acb.EngineConfig(max_adapters=-1)
    async with acb.Engine(tiny_model("llama"), config=config(max_adapters=0)) as engine:
        with pytest.raises(ValueError, match="max_adapters=0"):
            await engine.load_adapter(tiny_lora_model("llama", seed=1), "a")


async def test_prefix_cache_is_keyed_by_adapter():
    a = tiny_lora_model("llama", seed=1)
    prompt = random_prompts(1, 40, 40, seed=9)[0]
    async with acb.Engine(tiny_model("llama"), config=config()) as engine:
        await engine.load_adapter(a, "a")
        base = await engine.generate(prompt, max_new_tokens=6, ignore_eos=True)
        with_a = await engine.generate(prompt, adapter="a", max_new_tokens=6, ignore_eos=True)
        again = await engine.generate(prompt, adapter="a", max_new_tokens=6, ignore_eos=True)
    assert with_a.metrics.num_cached_prompt_tokens == 0  # the base model's pages are not the adapter's
    assert again.metrics.num_cached_prompt_tokens > 0  # its own pages are
    assert with_a.token_ids == again.token_ids == reference_greedy(a, prompt, 6)
    assert base.token_ids == reference_greedy(tiny_model("llama"), prompt, 6)


async def test_kv_events_carry_the_adapters_lora_id():
    """An adapter's registered pages are published with its lora_id (``engine.adapter_ids()``),
    as they are registered and in a resync; the base model's with None; the hashes are those
    ``prefix_page_hashes`` gives under that lora_id."""
    a, b = tiny_lora_model("llama", seed=1), tiny_lora_model("llama", seed=2)
    prompt = random_prompts(1, 40, 40, seed=9)[0]
    async with acb.Engine(tiny_model("llama"), config=config(kv_events=True, max_adapters=2)) as engine:
        stream = engine.kv_events()
        assert stream.pending()[0].resync  # (empty) from here on, the events as pages are registered
        await engine.load_adapter(a, "a")
        await engine.load_adapter(b, "b")
        ids = engine.adapter_ids()
        assert set(ids) == {"a", "b"} and ids["a"] != ids["b"] and all(isinstance(v, int) for v in ids.values())
        for name in (None, "a", "b"):
            await engine.generate(prompt, max_new_tokens=2, ignore_eos=True, adapter=name)
        stored = [e for batch in stream.pending() for e in batch.events if isinstance(e, acb.BlockStored)]
        resync = [e for batch in engine.kv_events().pending() for e in batch.events if isinstance(e, acb.BlockStored)]
    for events in (stored, resync):
        by_lora: dict = {}
        for e in events:
            by_lora.setdefault(e.lora_id, []).extend(e.block_hashes)
        assert set(by_lora) == {None, ids["a"], ids["b"]}
        for lora_id, hashes in by_lora.items():  # (the hashes a lookup can hit: every page but the last token's)
            want = acb.prefix_page_hashes(prompt, 8, lora_id=lora_id)
            assert len(want) == 4 and hashes[:4] == want


def test_prefix_page_hashes_base_unchanged_and_adapter_apart():
    ids = list(range(3, 40))
    assert acb.prefix_page_hashes(ids, 8) == acb.prefix_page_hashes(ids, 8, lora_id=None)
    assert set(acb.prefix_page_hashes(ids, 8, lora_id=7)).isdisjoint(acb.prefix_page_hashes(ids, 8))


async def test_load_and_unload_while_streams_run():
    a, b = tiny_lora_model("llama", seed=1), tiny_lora_model("llama", seed=2)
    prompts = random_prompts(6, 5, 15, seed=11)
    async with acb.Engine(tiny_model("llama"), config=config(max_adapters=2)) as engine:
        await engine.load_adapter(a, "a")
        handles = [engine.submit(p, adapter="a" if i % 2 else None, max_new_tokens=24, ignore_eos=True)
                   for i, p in enumerate(prompts)]
        await engine.load_adapter(b, "b")  # while they run
        late = engine.submit(prompts[0], adapter="b", max_new_tokens=8, ignore_eos=True)
        unloading = asyncio.ensure_future(engine.unload_adapter("a"))
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError, match="being unloaded"):
            engine.submit(prompts[0], adapter="a")
        assert engine.adapters() == ["b"]
        assert not unloading.done()  # it waits for the requests running "a"
        results = [await h for h in handles]
        await unloading  # returns once every request that ran "a" has ended
        assert (await late).token_ids == reference_greedy(b, prompts[0], 8)
    for i, (got, p) in enumerate(zip(results, prompts)):
        assert got.token_ids == reference_greedy(a if i % 2 else tiny_model("llama"), p, 24), f"request {i}"


async def test_adapters_with_choices_preemption_and_offload():
    """n > 1 forks run the request's adapter; rows preempted (their KV offloaded to the host
    and restored) resume with theirs."""
    a = tiny_lora_model("llama", seed=1)
    prompts = random_prompts(6, 10, 30, seed=13)
    names = ["a", None, "a", "a", None, "a"]
    cfg = config(page_size=4, num_blocks=24, max_batch_tokens=24, max_requests_per_batch=8, safety_margin=0.0,
                 cpu_offload_space=0.01)
    async with acb.Engine(tiny_model("llama"), config=cfg) as engine:
        await engine.load_adapter(a, "a")
        results = await asyncio.gather(*(engine.generate(p, adapter=n, max_new_tokens=16, ignore_eos=True)
                                         for p, n in zip(prompts, names)))
        choices = await engine.generate(prompts[0], adapter="a", n=2, max_new_tokens=8, ignore_eos=True)
        stats = engine.stats()
    assert stats.preemptions > 0 and stats.offloads > 0
    for got, p, n in zip(results, prompts, names):
        assert got.token_ids == reference_greedy(a if n else tiny_model("llama"), p, 16)
    assert [c.token_ids for c in choices.choices] == [reference_greedy(a, prompts[0], 8)] * 2


@pytest.mark.extras  # ~20 s on a quiet machine: CI's second step (the default suite is near its budget)
# peft's get_peft_model reads transformers' deprecated is_gradient_checkpointing (as acb.testing.tiny_lora_model notes)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
async def test_smollm2_mixed_adapters_match_peft_generate():
    """The real SmolLM2-135M (tied embeddings, 30 layers): two adapters and the base in one batch."""
    from acb.model.loading import load, smollm2

    model, tok = load(*smollm2(), dtype="float32")
    adapters = {}
    for name, seed in (("a", 1), ("b", 2)):
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS)))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, p in peft.named_parameters():
                if "lora_" in key:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        adapters[name] = peft.eval()
    questions = ["What is the capital of France?", "Why is the sky blue?"]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for q in questions]
    jobs = [(p, n) for p in prompts for n in (None, "a", "b")]
    expected = [reference_greedy(adapters[n] if n else model, p, 10) for p, n in jobs]
    assert all(e != expected[i - i % 3] for i, e in enumerate(expected) if i % 3), "an adapter changed nothing"
    async with acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(num_blocks=128, dtype="float32")) as engine:
        for name, peft in adapters.items():
            await engine.load_adapter(peft, name)
        results = await asyncio.gather(*(engine.generate(p, adapter=n, max_new_tokens=10, ignore_eos=True)
                                         for p, n in jobs))
    assert [r.token_ids for r in results] == expected


async def test_structured_output_with_an_adapter():
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (acb[structured])")
    async with acb.Engine(tiny_model("llama"), tokenizer=tiny_tokenizer(), config=config()) as engine:
        await engine.load_adapter(tiny_lora_model("llama", seed=1), "a")
        out = await engine.generate("Pick one:", adapter="a", choice=["yes", "no"], max_new_tokens=8)
    assert out.text in ("yes", "no")


@pytest.mark.parametrize("fields, name", [(dict(compile_level=1), "compile_level"),
                                          (dict(tensor_parallel_size=2), "tensor_parallel_size"),
                                          (dict(quantization="int8"), "quantization")])
def test_engines_that_cannot_run_adapters_name_the_setting(fields, name):
    from acb.model import lora

    assert name.split("_size")[0] in lora.why_not(tiny_model("llama"), acb.EngineConfig(**fields))


async def test_a_reused_slot_holds_only_its_new_adapter():
    """Unloaded, a rank-8 adapter on every projection leaves its slot to a rank-2 one on q/v only:
    nothing of the first remains in the batched path's view of the whole stack."""
    big = tiny_lora_model("llama", seed=1, r=8)
    small = tiny_lora_model("llama", seed=2, r=2, targets=["q_proj", "v_proj"])
    other = tiny_lora_model("llama", seed=3)
    prompts = random_prompts(4, 5, 12, seed=17)
    names = ["small", "other", "small", "other"]
    async with acb.Engine(tiny_model("llama"), config=config(max_adapters=2, max_adapter_rank=8)) as engine:
        await engine.load_adapter(big, "big")
        await engine.unload_adapter("big")
        await engine.load_adapter(small, "small")  # the big one's slot
        await engine.load_adapter(other, "other")
        results = await asyncio.gather(*(engine.generate(p, adapter=n, max_new_tokens=8, ignore_eos=True)
                                         for p, n in zip(prompts, names)))
    models = {"small": small, "other": other}
    assert [r.token_ids for r in results] == [reference_greedy(models[n], p, 8) for p, n in zip(prompts, names)]


async def test_adapters_run_in_bfloat16():
    """bf16 (what Engine.from_pretrained picks on CPUs with native bf16): the adapter's weights
    are cast to the model's dtype and change the output; its first tokens match PEFT's in bf16."""
    a = tiny_lora_model("llama", seed=1)
    prompts = random_prompts(4, 5, 12, seed=19)
    names = ["a", None, "a", None]
    engine = acb.Engine(tiny_model("llama"), config=config(dtype="bfloat16"))
    async with engine:
        await engine.load_adapter(a, "a")
        results = await asyncio.gather(*(engine.generate(p, adapter=n, max_new_tokens=4, ignore_eos=True)
                                         for p, n in zip(prompts, names)))
        stats = engine.stats()
        # the fused bf16 forward where acb's bf16 GEMMs run (AVX-512 BF16, or widened on AVX2);
        # elsewhere transformers' forward serves, and the engine says why
        fused = native_bf16() is not None
        assert (stats.dtype, stats.forward_path) == ("bfloat16", "fused" if fused else "transformers")
        assert fused or "no fast kernels on this CPU" in stats.forward_reason
    ref_a, ref_base = a.to(torch.bfloat16), tiny_model("llama").to(torch.bfloat16)
    firsts = [r.token_ids[0] for r in results]
    assert firsts == [reference_greedy(ref_a if n else ref_base, p, 1)[0] for p, n in zip(prompts, names)]
    assert any(firsts[i] != reference_greedy(ref_base, prompts[i], 1)[0] for i in (0, 2)), "the adapter changed nothing"


async def test_attention_only_adapters_keep_the_fused_mlp():
    """PEFT's default targets for Llama (q_proj, v_proj): the MLP keeps its fused epilogues."""
    a = tiny_lora_model("llama", seed=6, targets=["q_proj", "v_proj"])
    prompts = random_prompts(4, 5, 20, seed=23)
    names = ["a", None, "a", "a"]
    async with acb.Engine(tiny_model("llama"), config=config()) as engine:
        await engine.load_adapter(a, "a")
        results = await asyncio.gather(*(engine.generate(p, adapter=n, max_new_tokens=8, ignore_eos=True)
                                         for p, n in zip(prompts, names)))
    models = {"a": a, None: tiny_model("llama")}
    assert [r.token_ids for r in results] == [reference_greedy(models[n], p, 8) for p, n in zip(prompts, names)]


async def test_adapters_with_speculation_match_peft_generate():
    """n-gram speculation over rows of two adapters and the base: each row still gives PEFT's
    own greedy tokens (the proposals are verified with the row's adapter), and proposals
    were made and both accepted and rejected."""
    from acb.testing import speculate_always

    a, b = tiny_lora_model("llama", seed=1, r=4), tiny_lora_model("llama", seed=2, r=8)
    loop = random_prompts(2, 6, 10, seed=9)
    prompts = [[5, 6, 7] * 4, loop[0] + loop[0][:-2], [17] * 11, loop[1] + loop[1][:-3]]
    names = ["a", "b", None, "a"]
    models = {None: tiny_model("llama"), "a": a, "b": b}
    expected = [reference_greedy(models[n], p, 24) for n, p in zip(names, prompts)]
    assert all(e != reference_greedy(models[None], p, 24) for e, p, n in zip(expected, prompts, names) if n)
    engine = acb.Engine(tiny_model("llama"), config=config(max_adapters=2, max_adapter_rank=8,
                                                           speculative_method="ngram", debug_checks=True))
    speculate_always(engine)
    async with engine:
        await engine.load_adapter(a, "a")
        await engine.load_adapter(b, "b")
        results = await asyncio.gather(*(engine.generate(p, adapter=n, max_new_tokens=24, ignore_eos=True,
                                                         temperature=0) for p, n in zip(prompts, names)))
        stats = engine.stats()
        engine.check_integrity()
    for got, want, n in zip(results, expected, names):
        assert got.token_ids == want, f"adapter {n!r} diverged from PEFT's generate under speculation"
    assert stats.spec_proposed_tokens > 0 and 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
