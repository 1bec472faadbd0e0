"""acb computes what the user's model computes, even when the model changes under a
running engine (issue 16): hooks registered while it runs are called (so a fault
injected through one fails that step's requests only), a replaced ``forward`` runs,
weights loaded or edited in place are served from the next step, and the user's
own ``model.generate`` works beside the engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from reliability_helpers import consume, expected, four_running_two_queued, idle_and_free, until

import acb
from acb.testing import random_prompts, reference_greedy, runner_of, step_counts, tiny_model

PROMPTS = random_prompts(8, 3, 12, seed=61)  # the reliability helpers' prompts (cached references)
LONG = random_prompts(1, 30, 30, seed=5)[0]  # spans several pages: a prefix-cache hit when repeated


def own_generate(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The user's own ``model.generate`` (greedy), on the model object the engine holds."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def fresh_reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens on a new copy of ``model`` as it is now."""
    model.__dict__.pop("_acb_reference", None)
    return reference_greedy(model, prompt, n)


async def test_fault_injected_through_a_hook_registered_while_running_fails_only_that_step():
    model = tiny_model()
    engine = acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=8, max_requests_per_batch=4))
    async with engine:
        assert runner_of(engine).fast_paths.fused is not None, "the fused forward should stand in for this model"
        in_step, streams, got, queued = await four_running_two_queued(engine)
        error = RuntimeError("injected through a forward hook")
        fired = []

        def hook(module, args, output):
            if not fired:
                fired.append(1)
                raise error

        handle = model.model.layers[1].register_forward_hook(hook)
        for h, it, toks, p in zip(in_step, streams, got, PROMPTS):
            with pytest.raises(acb.RequestFailedError) as failed:
                await consume(it, toks)
            assert failed.value.__cause__ is error
            assert toks == expected(p, len(toks)) and len(toks) < 60
        assert fired == [1]
        assert [(await h).token_ids for h in queued] == [expected(p, 6) for p in PROMPTS[4:6]]
        assert step_counts(engine).plain > 0
        handle.remove()
        plain = step_counts(engine).plain
        assert (await engine.generate(PROMPTS[6], max_new_tokens=8, ignore_eos=True)).token_ids == \
            expected(PROMPTS[6], 8)
        assert step_counts(engine).plain == plain  # the fast path is back once the hook is gone
        await until(lambda: idle_and_free(engine))
        engine.check_integrity()


@pytest.mark.parametrize("kind", ["module_pre", "global", "replaced_forward"])
async def test_hooks_and_replaced_forwards_change_the_tokens_like_generate(kind):
    model = tiny_model()
    layer = model.model.layers[0]
    calls = []

    def steer(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return hidden * 1.5 + 0.25

    undo = []
    if kind == "module_pre":
        undo.append(layer.mlp.register_forward_pre_hook(lambda m, args: (steer(args[0]),)).remove)
    elif kind == "global":
        def global_hook(module, args, output):
            return steer(output) if module is layer.mlp else None

        undo.append(torch.nn.modules.module.register_module_forward_hook(global_hook).remove)
    else:
        original = layer.mlp.forward
        layer.mlp.forward = lambda x: original(steer(x))
        undo.append(lambda: layer.mlp.__dict__.pop("forward"))
    try:
        async with acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=8)) as engine:
            got = await engine.generate_batch(PROMPTS[:3], max_new_tokens=10, ignore_eos=True)
            want = [own_generate(model, p, 10) for p in PROMPTS[:3]]
    finally:
        for u in undo:
            u()
    assert calls
    assert [g.token_ids for g in got] == want
    assert want != [expected(p, 10) for p in PROMPTS[:3]], "the steering should change the tokens"


async def test_weights_loaded_or_edited_while_running_are_served_from_the_next_step():
    model = tiny_model()
    other = tiny_model(seed=7).state_dict()
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=8)) as engine:
        before = await engine.generate(LONG, max_new_tokens=12, ignore_eos=True)
        # the weight check runs in C++ where acb's CPU kernels are built (the Python one otherwise)
        assert (runner_of(engine).fast_paths.watch._native is not None) == (_watch_kinds()[-1] is not None)
        assert before.token_ids == fresh_reference(model, LONG, 12)
        background = engine.submit(PROMPTS[0], max_new_tokens=200, ignore_eos=True)  # keeps steps going

        model.load_state_dict(other)  # an RL loop's weight sync
        after = await engine.generate(LONG, max_new_tokens=12, ignore_eos=True)
        want = fresh_reference(model, LONG, 12)
        assert want != before.token_ids
        assert after.token_ids == want
        assert after.metrics.num_cached_prompt_tokens == 0  # KV of the old weights is never reused

        with torch.no_grad():  # in place, on a tied or packed weight alike
            model.model.layers[0].mlp.up_proj.weight.mul_(-1.0)
            model.model.embed_tokens.weight.add_(0.05)
        edited = await engine.generate(LONG, max_new_tokens=12, ignore_eos=True)
        assert edited.token_ids == fresh_reference(model, LONG, 12) != want
        assert edited.token_ids == own_generate(model, LONG, 12)  # the user's generate sees them too

        # ``.data`` writes bypass the version counter: reload_weights() takes them
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.weight.data.copy_(other["model.layers.0.self_attn.o_proj.weight"])
        await engine.reload_weights()
        reloaded = await engine.generate(LONG, max_new_tokens=12, ignore_eos=True)
        assert reloaded.token_ids == fresh_reference(model, LONG, 12) != edited.token_ids
        background.cancel()
        await until(lambda: idle_and_free(engine))
        engine.check_integrity()


async def test_users_generate_works_beside_a_running_engine():
    model = tiny_model("qwen2")
    own = model.config._attn_implementation
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=8)) as engine:
        assert model.config._attn_implementation == own  # acb's attention only inside its steps
        stream = engine.submit(PROMPTS[1], max_new_tokens=40, ignore_eos=True)
        mine = await asyncio.to_thread(own_generate, model, PROMPTS[2], 10)  # while the engine steps
        # a padded batch: the user's attention mask must still be honoured
        ids = torch.tensor([[0, 0, *LONG[:6]], LONG[10:18]])
        mask = torch.tensor([[0, 0] + [1] * 6, [1] * 8])
        with torch.inference_mode():
            padded = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        served = await stream
    ref = tiny_model("qwen2")
    assert mine == reference_greedy(ref, PROMPTS[2], 10)
    assert padded[0, 8:].tolist() == reference_greedy(ref, LONG[:6], 6)
    assert padded[1, 8:].tolist() == reference_greedy(ref, LONG[10:18], 6)
    assert served.token_ids == reference_greedy(ref, PROMPTS[1], 40)
    assert model.config._attn_implementation == own and type(model.config) is type(ref.config)


def _watch_kinds():
    from acb.kernels.cpu import fused_kernels

    kernels = fused_kernels()
    return [None] + ([kernels.WeightWatch] if kernels is not None else [])


@pytest.mark.parametrize("native", _watch_kinds(), ids=lambda n: "python" if n is None else "native")
def test_the_weight_check_sees_each_kind_of_change_and_nothing_else(native):
    """ModelWatch.weights_changed, in Python and in acb's C++ loop (acb/kernels/csrc/torch_bindings.cpp's
    WeightWatch, what the engine runs where its CPU kernels are built): a parameter edited in place,
    replaced in its module, given new storage through ``.data``, or deleted; a buffer replaced; each
    seen, and nothing once the watch takes the model as it is. An inference tensor keeps no version
    counter, so only its replacement shows."""
    from acb.model.watch import ModelWatch

    model = tiny_model()
    model.model.register_buffer("acb_test_frozen", _frozen(), persistent=False)
    watch = ModelWatch(model, native=native)
    assert (watch._native is not None) == (native is not None)
    assert not watch.weights_changed()
    assert not watch.weights_changed()  # checking changes nothing
    up = model.model.layers[0].mlp.up_proj
    edits = [
        lambda: _in_place(up.weight),
        lambda: setattr(up, "weight", torch.nn.Parameter(up.weight.detach().clone())),
        lambda: setattr(up.weight, "data", up.weight.detach().clone()),
        lambda: model.model.register_buffer("acb_test_frozen", _frozen(), persistent=False),
        lambda: delattr(model.model.layers[1].mlp.down_proj, "weight"),
    ]
    for edit in edits:
        edit()
        assert watch.weights_changed()
        watch.snapshot() if edit is edits[-1] else watch.snapshot_weights()
        assert not watch.weights_changed()
    with torch.inference_mode():
        model.model.acb_test_frozen.add_(1.0)  # no version counter to see it by
    assert not watch.weights_changed()


def _frozen() -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones(4)


def _in_place(weight: torch.nn.Parameter) -> None:
    with torch.no_grad():
        weight.mul_(-1.0)
