"""Embeddings from the engine that generates (``Engine.embed``, ``POST /v1/embeddings``, batch
files): pooled final hidden states equal transformers' within 1e-4 in float32, on every tiny
architecture and on SmolLM2, with generation in the same steps, chunked prefill and the prefix
cache; a thousand texts do not starve a streaming chat; bad input is refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch

import acb
from acb.testing import ARCHITECTURES, random_prompts, reference_embedding, reference_greedy, tiny_model

TOL = 1e-4


def _engine(arch: str = "llama", fused: bool = True, **fields) -> acb.Engine:
    fields = {"num_blocks": 256, "page_size": 8, "dtype": "float32", "debug_checks": True, **fields}
    return acb.Engine(tiny_model(arch), tokenizer=acb.testing.tiny_tokenizer(),
                      config=acb.EngineConfig(cpu_fused_forward=fused, **fields))


def _record_steps(engine: acb.Engine) -> list[tuple[int, int]]:
    """Per step the engine plans from now on: (rows that sample, prompt tokens of its embedding rows)."""
    scheduler = engine.scheduler
    steps: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        if plan.seqs:
            counts = plan.input.counts()
            steps.append((sum(plan.input.sample), sum(n for seq, n in zip(plan.seqs, counts) if seq.prefill_only)))
        return plan

    scheduler.schedule = recording
    return steps


def _max_error(got: list[float], want: torch.Tensor) -> float:
    return (torch.tensor(got) - want).abs().max().item()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
async def test_pooled_vectors_equal_transformers_beside_generation(arch, fused):
    """last, mean and cls pooling equal transformers' base model's last_hidden_state pooled the same way,
    with greedy chats in the same steps (which still equal transformers' generate token for token)."""
    model_prompts = random_prompts(6, 2, 70, seed=3)
    chat_prompts = random_prompts(2, 5, 20, seed=4)
    engine = _engine(arch, fused, max_batch_tokens=48, max_embedding_tokens=24)
    async with engine:
        steps = _record_steps(engine)
        chats = [engine.submit(p, max_new_tokens=10, ignore_eos=True) for p in chat_prompts]
        vectors = {pooling: await engine.embed(model_prompts, pooling=pooling, normalize=False)
                   for pooling in ("last", "mean", "cls")}
        normalized = await engine.embed(model_prompts)
        done = [await c for c in chats]
        path = engine.stats().forward_path
    assert path == ("fused" if fused else "transformers") or arch.startswith("gemma")
    assert any(sampled and pooled for sampled, pooled in steps), "no step held both a chat and an embedding"
    for pooling, got in vectors.items():
        for p, v in zip(model_prompts, got):
            want = reference_embedding(engine.model, p, pooling, normalize=False)
            assert len(v) == want.shape[0]
            assert _max_error(v, want) < TOL, (pooling, len(p))
    for p, v in zip(model_prompts, normalized):
        assert _max_error(v, reference_embedding(engine.model, p)) < TOL
        assert abs(sum(x * x for x in v) - 1) < 1e-5
    for p, c in zip(chat_prompts, done):
        assert c.token_ids == reference_greedy(engine.model, p, 10)


async def test_long_prompts_are_pooled_across_chunks():
    """A prompt longer than a step's embedding share is computed in chunks; mean pooling sums them all."""
    prompt = random_prompts(1, 150, 150, seed=5)[0]
    async with _engine(max_batch_tokens=64, max_embedding_tokens=16) as engine:
        steps = _record_steps(engine)
        chat = engine.submit([5, 6, 7], max_new_tokens=40, ignore_eos=True)
        (mean,) = await engine.embed([prompt], pooling="mean", normalize=False)
        (last,) = await engine.embed(prompt, pooling="last", normalize=False)
        await chat
    pooled = [n for _, n in steps if n]
    assert len(pooled) >= 150 // 16 and max(pooled) <= 16
    assert _max_error(mean, reference_embedding(engine.model, prompt, "mean", normalize=False)) < TOL
    assert _max_error(last, reference_embedding(engine.model, prompt, "last", normalize=False)) < TOL


async def test_a_chat_arriving_while_only_embeddings_run_waits_for_small_steps():
    """With no generation live the embedding share still bounds a step, so a chat arriving then
    starts within a few steps; a larger share holds more per step."""
    prompts = random_prompts(60, 30, 30, seed=6)
    for cap in (16, 128):
        async with _engine(max_batch_tokens=256, max_embedding_tokens=cap) as engine:
            steps = _record_steps(engine)
            batch = asyncio.ensure_future(engine.embed(prompts))
            while len(steps) < 3:
                await asyncio.sleep(0)
            before = len(steps)
            await engine.generate([5, 6, 7], max_new_tokens=1)
            waited = len(steps) - before
            await batch
        assert max(n for _, n in steps) == cap
        assert waited <= 3  # the steps in flight, then the chat's own


async def test_the_prefix_cache_never_changes_a_vector():
    """last pooling starts from cached pages (the last position is always computed, a fully cached
    prompt included); mean pooling computes every position whatever the cache holds."""
    prompt = random_prompts(1, 40, 40, seed=7)[0]
    async with _engine() as engine:
        await engine.generate(prompt, max_new_tokens=2)  # its prompt's full pages are cached now
        hits = engine.kv.prefix_hits
        (last,) = await engine.embed(prompt, normalize=False)
        assert engine.kv.prefix_hits > hits  # started from the cache
        hits = engine.kv.prefix_hits
        (mean,) = await engine.embed(prompt, pooling="mean", normalize=False)
        assert engine.kv.prefix_hits == hits  # did not
        (again,) = await engine.embed(prompt, normalize=False)
    assert _max_error(last, reference_embedding(engine.model, prompt, "last", normalize=False)) < TOL
    assert _max_error(again, reference_embedding(engine.model, prompt, "last", normalize=False)) < TOL
    assert _max_error(mean, reference_embedding(engine.model, prompt, "mean", normalize=False)) < TOL


@pytest.mark.parametrize("offload", [0.0, 0.01], ids=["recompute", "offload"])
async def test_preempted_embedding_prompts_pool_each_position_once(offload):
    """Embedding prompts that preempt each other for pages (recomputed, or restored from host memory)
    pool every position exactly once: their vectors stay transformers'."""
    prompts = random_prompts(6, 60, 90, seed=12)
    engine = _engine(num_blocks=14, max_batch_tokens=40, max_embedding_tokens=40, safety_margin=0.0,
                     cpu_offload_space=offload)
    async with engine:
        got = {p: await engine.embed(prompts, pooling=p, normalize=False) for p in ("mean", "last")}
        stats = engine.stats()
    assert stats.preemptions > 0 and (stats.offloads > 0) == bool(offload)
    for pooling, vectors in got.items():
        for p, v in zip(prompts, vectors):
            assert _max_error(v, reference_embedding(engine.model, p, pooling, normalize=False)) < TOL


@pytest.mark.extras  # ~45 s on two cores (1,000 requests through the scheduler): CI's extras step
async def test_a_thousand_texts_do_not_starve_a_streaming_chat(tokenizer):
    """A chat streams while 1,000 texts are embedded in the same engine: it is admitted ahead of
    the queued embeddings, and every step it runs in holds at most max_embedding_tokens of them."""
    texts = [f"document number {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(1000)]
    async with _engine(max_batch_tokens=256, max_embedding_tokens=32, num_blocks=512) as engine:
        steps = _record_steps(engine)
        batch = asyncio.ensure_future(engine.embed(texts, pooling="mean"))
        while not engine.stats().running:  # the batch is running
            await asyncio.sleep(0)
        stats = engine.stats()
        assert stats.embeddings_waiting > 900 and stats.waiting == 0  # queued apart from generation
        arrivals = []
        async for chunk in engine.stream("hello there", max_new_tokens=24, ignore_eos=True):
            arrivals.append(batch.done())
        vectors = await batch
    assert len(vectors) == 1000 and len(set(map(tuple, vectors))) > 990
    assert len(arrivals) >= 1 and not any(arrivals), "the chat waited for the embedding batch"
    chat_steps = [pooled for sampled, pooled in steps if sampled]
    assert len(chat_steps) >= 24 and max(chat_steps) <= 32


async def test_bad_input_is_refused_by_name_and_the_engine_goes_on():
    async with _engine() as engine:
        cases = [([], "inputs is empty"), ([""], r"inputs\[0\]: prompt is empty"),
                 (["ok", [1, 2, 999999]], r"inputs\[1\]: prompt token id 999999"),
                 ([[1] * 5000], r"inputs\[0\] is 5000 tokens, more than this engine can hold"),
                 ([{"role": "user"}], r"inputs\[0\] must be a string or a list of token ids"), (3, "inputs must be")]
        for inputs, message in cases:
            with pytest.raises(acb.InvalidRequestError, match=message) as e:
                await engine.embed(inputs)
            assert e.value.param == "inputs"
        with pytest.raises(acb.InvalidRequestError, match="pooling must be one of 'last', 'mean', 'cls', got 'max'"):
            await engine.embed("hi", pooling="max")
        with pytest.raises(acb.InvalidRequestError, match="normalize must be a bool"):
            await engine.embed("hi", normalize="yes")
        assert len((await engine.embed(["still", "serving"]))[1]) == 64
        assert (await engine.generate("still serving", max_new_tokens=3)).finish_reason == "length"


async def test_cancelling_the_call_cancels_its_prompts():
    prompts = random_prompts(200, 20, 40, seed=8)
    async with _engine(max_batch_tokens=32) as engine:
        task = asyncio.ensure_future(engine.embed(prompts))
        while not engine.stats().running:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        await engine.generate("after", max_new_tokens=2)  # a step after the cancel: pages back
        stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.free_blocks == stats.total_blocks


async def test_a_hard_stop_fails_the_embedding_call():
    async with _engine(max_batch_tokens=32) as engine:
        task = asyncio.ensure_future(engine.embed(random_prompts(100, 20, 40, seed=9)))
        while not engine.stats().running:
            await asyncio.sleep(0)
        await engine.stop(hard=True)
        with pytest.raises(acb.EngineStoppedError):
            await asyncio.wait_for(task, 30)


@pytest.mark.slow
async def test_smollm2_embeddings_and_cosine_similarities_equal_transformers():
    """On the real model in float32: last and mean pooled vectors within 1e-4 of transformers',
    batched with a streaming chat, and the sentence-transformers-style cosine similarity matrix
    agrees too (the same nearest neighbour for each sentence)."""
    from acb.loading import load, smollm2

    model, tok = load(*smollm2(), dtype="float32")
    sentences = ["A cat sits on the mat.", "A kitten is resting on a rug.", "The stock market fell sharply today.",
                 "Shares dropped at the close of trading.", "How do I bake bread at home?",
                 "A simple recipe for homemade bread."]
    config = acb.EngineConfig(num_blocks=128, max_batch_tokens=64, max_embedding_tokens=16, dtype="float32")
    async with acb.Engine(model, tokenizer=tok, config=config) as engine:
        steps = _record_steps(engine)
        chat = engine.submit([{"role": "user", "content": "Name a cat breed."}], max_new_tokens=16)
        got = {p: await engine.embed(sentences, pooling=p) for p in ("last", "mean")}
        await chat
    assert any(sampled and pooled for sampled, pooled in steps), "no step held both the chat and embeddings"
    for pooling, vectors in got.items():
        want = torch.stack([reference_embedding(model, tok(s)["input_ids"], pooling) for s in sentences])
        have = torch.tensor(vectors)
        assert (have - want).abs().max().item() < TOL, pooling
        cos_have, cos_want = have @ have.T, want @ want.T
        assert (cos_have - cos_want).abs().max().item() < TOL, pooling
        assert torch.equal((cos_have - 2 * torch.eye(6)).argmax(1), (cos_want - 2 * torch.eye(6)).argmax(1))


# ---------------------------------------------------------------------------- the wire


@pytest.fixture
async def served():
    from http_helpers import running_app

    from acb.integrations.aiohttp import ENGINE_KEY
    from acb.serving.server import ServerConfig, create_app

    openai = pytest.importorskip("openai")
    app = create_app(acb.testing.tiny_engine(max_batch_tokens=64, max_embedding_tokens=16), ServerConfig(
        model_name="tiny"))
    async with running_app(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        yield client, app[ENGINE_KEY], url
        await client.close()


async def test_the_openai_client_gets_the_engines_vectors_and_usage(served):
    """embeddings.create (the client asks for base64 and decodes it itself) answers the engine's own
    vectors, in input order, with usage counting the inputs' tokens; token-id inputs too."""
    client, engine, _ = served
    texts = ["a cat sat on the mat", "the stock market fell", "bread at home"]
    answer = await client.embeddings.create(model="tiny", input=texts)
    want = await engine.embed(texts)
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "tiny" and answer.object == "list"
    for d, w in zip(answer.data, want):
        assert d.object == "embedding" and len(d.embedding) == 64
        assert _max_error(d.embedding, torch.tensor(w)) == 0
        assert _max_error(d.embedding, reference_embedding(engine.model, engine.tokenize(texts[d.index]))) < TOL
    tokens = sum(len(engine.tokenize(t)) for t in texts)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (tokens, tokens)
    ids = [engine.tokenize(t) for t in texts]
    by_ids = await client.embeddings.create(model="tiny", input=ids, encoding_format="float",
                                            extra_body={"pooling": "mean", "normalize": False})
    for d, p in zip(by_ids.data, ids):
        assert _max_error(d.embedding, reference_embedding(engine.model, p, "mean", normalize=False)) < TOL
    one = await client.embeddings.create(model="tiny", input=ids[0], user="someone")
    assert len(one.data) == 1 and _max_error(one.data[0].embedding, torch.tensor(want[0])) < 1e-6


async def test_base64_is_little_endian_float32_of_the_float_answer(served):
    import base64

    import numpy as np

    _, engine, url = served
    import aiohttp

    async with aiohttp.ClientSession() as session:
        body = {"model": "tiny", "input": ["one text", "another text"]}
        async with session.post(f"{url}/v1/embeddings", json={**body, "encoding_format": "float"}) as r:
            floats = [d["embedding"] for d in (await r.json())["data"]]
        async with session.post(f"{url}/v1/embeddings", json={**body, "encoding_format": "base64"}) as r:
            encoded = [d["embedding"] for d in (await r.json())["data"]]
    assert all(isinstance(e, str) for e in encoded)
    decoded = [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in encoded]
    assert [d.tolist() for d in decoded] == floats  # float32 values both ways, bit for bit


async def test_a_streaming_chat_and_an_embedding_batch_share_the_server(served):
    client, _, _ = served
    texts = [f"text number {i} " * 3 for i in range(200)]
    batch = asyncio.ensure_future(client.embeddings.create(model="tiny", input=texts))
    tokens = []
    stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=16, temperature=0, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            tokens.append(batch.done())
    answer = await batch
    assert len(answer.data) == 200 and tokens and not all(tokens)


BAD_BODIES = [  # (body, the field the 400 names, what its message says)
    ({"input": "x", "dimensions": 32}, "dimensions", "'dimensions' is not supported"),
    ({"input": []}, "input", "'input' must be a non-empty string"),
    ({}, "input", "'input' must be a non-empty string"),
    ({"input": ["ok", ""]}, "input", "'input[1]' is an empty string"),
    ({"input": [[1, 2], "x", [3, True]]}, "input", "'input[2]' must be a non-empty string or a non-empty list"),
    ({"input": [[1, 99999]]}, "input", "'input[0]' cannot be embedded: prompt token id 99999 is out"),
    ({"input": "x" * 3000}, "input", "input[0] is 3000 tokens, more than this engine can hold (1024"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "must be 'float' or 'base64'"),
    ({"input": "x", "pooling": "max"}, "pooling", "must be 'last', 'mean' or 'cls'"),
    ({"input": "x", "normalize": "yes"}, "normalize", "must be a boolean"),
    ({"input": "x", "normalize": 0}, "normalize", "must be a boolean"),  # 0 == False in Python, not in JSON
    ({"input": "x", "pooling": ""}, "pooling", "must be 'last', 'mean' or 'cls'"),
    ({"input": "x", "encoding_format": 0}, "encoding_format", "must be 'float' or 'base64'"),
    ({"input": "x", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "is not supported"),
    ({"input": "x", "add_special_tokens": False}, "add_special_tokens", "must be true"),
    ({"input": "x", "add_special_tokens": 1}, "add_special_tokens", "must be true"),
    ({"input": "x", "user": 5}, "user", "must be a string"),
    ({"input": "x", "model": {}}, "model", "'model' must be a string"),
]


async def test_bad_bodies_get_a_400_naming_the_field_and_the_server_goes_on(served):
    import aiohttp

    _, engine, url = served
    async with aiohttp.ClientSession() as session:
        for body, param, needle in BAD_BODIES:
            async with session.post(f"{url}/v1/embeddings", json={"model": "tiny", **body}) as r:
                assert r.status == 400, body
                error = (await r.json())["error"]
            assert error["param"] == param and needle in error["message"], (body, error)
            assert error["type"] == "invalid_request_error"
        async with session.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        async with session.post(f"{url}/v1/embeddings", json={"model": "tiny", "input": "still here"}) as r:
            assert r.status == 200 and len((await r.json())["data"][0]["embedding"]) == 64


async def test_a_batch_file_embeds_its_embedding_lines(tmp_path):
    """run-batch: /v1/embeddings lines answered with the engine's vectors beside chat lines; refusals as error lines."""
    import json

    from acb.integrations.batch_files import run_batch_file
    from acb.integrations.openai_service import OpenAIService

    texts = [f"line {i} to embed" for i in range(6)]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "tiny", "input": [t, t + "!"], "encoding_format": "float"}}
             for i, t in enumerate(texts)]
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}})
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "tiny", "input": "x", "dimensions": 8}})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    async with acb.testing.tiny_engine() as engine:
        summary = await run_batch_file(OpenAIService(engine, model_name="tiny"), tmp_path / "in.jsonl",
                                       tmp_path / "out.jsonl")
        want = {i: await engine.embed([t, t + "!"]) for i, t in enumerate(texts)}
    assert (summary.succeeded, summary.failed) == (7, 1)
    results = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i in range(6):
        body = results[f"e{i}"]["response"]["body"]
        assert results[f"e{i}"]["error"] is None and body["object"] == "list"
        assert [d["embedding"] for d in body["data"]] == want[i]
    assert results["chat"]["response"]["body"]["object"] == "chat.completion"
    bad = results["bad"]
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == "dimensions"
