"""Prompt logprobs on the wire: completions' ``echo`` + ``logprobs`` in the legacy shape
(prompt, then completion), ``max_tokens: 0`` scoring only, vLLM's ``prompt_logprobs`` on
both routes, and the exact body lm-evaluation-harness's ``local-completions`` model sends
for loglikelihood, read the way it reads it."""

from __future__ import annotations

from operator import itemgetter

import aiohttp
import pytest
from http_helpers import running_app, sse_json

from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.server import ServerConfig, create_app
from acb.testing import reference_log_softmax, tiny_engine

TOL = 1e-4


@pytest.fixture
async def server():
    engine = tiny_engine(max_batch_tokens=16, page_size=4)  # prompts computed in several chunks
    app = create_app(engine, ServerConfig(model_name="tiny"))
    async with running_app(app) as url, aiohttp.ClientSession(base_url=url) as session:
        yield session, app[ENGINE_KEY]


async def post(session, path: str, body: dict) -> tuple[int, dict]:
    async with session.post(path, json=body) as resp:
        return resp.status, await resp.json()


def lm_eval_payload(prompts: list[list[int]]) -> dict:
    """What lm-evaluation-harness 0.4.x's ``LocalCompletionsAPI._create_payload`` sends for
    loglikelihood requests (``generate=False``; token ids, batched)."""
    return {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def lm_eval_parse(answer: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """``LocalCompletionsAPI.parse_logprobs``, as the harness reads the answer."""
    res = []
    for choice, ctxlen in zip(sorted(answer["choices"], key=itemgetter("index")), ctxlens, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=True))
        res.append((sum(token_logprobs), is_greedy))
    return res


async def test_lm_eval_loglikelihood_body_is_answered_in_the_shape_it_parses(server):
    session, engine = server
    model = engine.model
    context = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]
    ref = reference_log_softmax(model, context + [60, 61, 62])
    greedy = [int(ref[len(context) - 1 + i].argmax()) for i in range(1)]
    continuations = [[60, 61, 62], greedy]
    prompts = [context + c for c in continuations]
    status, answer = await post(session, "/v1/completions", lm_eval_payload(prompts))
    assert status == 200, answer
    for choice, prompt in zip(answer["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    results = lm_eval_parse(answer, [len(context)] * 2)
    for (logprob, is_greedy), prompt, cont in zip(results, prompts, continuations):
        want_ref = reference_log_softmax(model, prompt)
        want = sum(want_ref[len(context) - 1 + i, t].item() for i, t in enumerate(cont))
        assert abs(logprob - want) < TOL * len(cont)
        want_greedy = all(int(want_ref[len(context) - 1 + i].argmax()) == t for i, t in enumerate(cont))
        assert is_greedy == want_greedy
    assert results[1][1] is True  # the greedy continuation is recognised as greedy


@pytest.mark.parametrize("streamed", [False, True])
async def test_echo_with_max_tokens_0_scores_the_prompt_only(server, streamed):
    session, engine = server
    prompt = "scoring only, nothing generated"
    ids = engine.tokenize(prompt)
    ref = reference_log_softmax(engine.model, ids)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0,
            "stream_options": {"include_usage": True}}
    if streamed:
        async with session.post("/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            events = await sse_json(resp)
        chunks = [e for e in events[:-1] if e["choices"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        lp = chunks[0]["choices"][0]["logprobs"]
        assert all(c["choices"][0]["logprobs"] is None for c in chunks[1:])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        usage = events[-2]["usage"]
    else:
        status, answer = await post(session, "/v1/completions", body)
        assert status == 200, answer
        text = answer["choices"][0]["text"]
        lp = answer["choices"][0]["logprobs"]
        assert answer["choices"][0]["finish_reason"] == "length"
        usage = answer["usage"]
    assert text == prompt
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
    assert len(lp["token_logprobs"]) == len(ids)
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOL
        assert len(lp["top_logprobs"][p]) <= 2
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(ref[p - 1].max().item(), abs=TOL)


async def test_echo_logprobs_cover_the_prompt_then_the_completion(server):
    session, engine = server
    status, answer = await post(session, "/v1/completions", {"prompt": "abc de", "max_tokens": 3, "echo": True,
                                                             "logprobs": 1, "temperature": 0, "ignore_eos": True})
    assert status == 200
    lp = answer["choices"][0]["logprobs"]
    plain = await engine.generate("abc de", max_new_tokens=3, ignore_eos=True, logprobs=True)
    assert len(lp["tokens"]) == len(plain.prompt_token_ids) + 3
    assert lp["token_logprobs"][-3:] == pytest.approx(plain.logprobs, abs=TOL)
    assert "".join(lp["tokens"]) == answer["choices"][0]["text"]
    assert lp["text_offset"][len(plain.prompt_token_ids)] == len("abc de")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("streamed", [False, True])
async def test_vllm_prompt_logprobs_field(server, path, streamed):
    session, engine = server
    chat = "chat" in path
    body = {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    body.update({"messages": [{"role": "user", "content": "hi there"}]} if chat else {"prompt": "hi there"})
    if streamed:
        async with session.post(path, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            events = await sse_json(resp)
        first = events[0]
        scores = first["prompt_logprobs"] if chat else first["choices"][0]["prompt_logprobs"]
        assert all("prompt_logprobs" not in e and "prompt_logprobs" not in e["choices"][0] for e in events[1:-1])
    else:
        status, answer = await post(session, path, body)
        assert status == 200, answer
        scores = answer["prompt_logprobs"] if chat else answer["choices"][0]["prompt_logprobs"]
    ids = engine.tokenize([{"role": "user", "content": "hi there"}] if chat else "hi there")
    ref = reference_log_softmax(engine.model, ids)
    assert len(scores) == len(ids) and scores[0] is None
    for p in range(1, len(ids)):
        entry = scores[p]
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - ref[p - 1, ids[p]].item()) < TOL
        assert mine["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert 2 <= len(entry) <= 3  # the token itself and the two most likely
        best = int(ref[p - 1].argmax())
        assert entry[str(best)]["rank"] == 1


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", "2"), ("max_tokens", 0),
])
async def test_bad_prompt_logprobs_fields_are_400_naming_them(server, field, value):
    session, _ = server
    status, error = await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert status == 400
    assert error["error"]["param"] == field


@pytest.mark.extras  # needs acb[eval] (lm-evaluation-harness), installed by setup.sh --extras
async def test_lm_evaluation_harness_local_completions_matches_its_transformers_backend(server, tmp_path):
    """The harness itself: its ``local-completions`` model against this server, item by item
    against its own transformers backend (``HFLM``) on the same weights."""
    import asyncio

    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from acb.testing import tiny_model

    session, engine = server
    engine.tokenizer.save_pretrained(tmp_path)
    items = [("The cat sat on the", " mat"), ("The cat sat on the", " hat and more"), ("1 + 1 =", " 2"),
             ("Once upon a time,", " there was a cache"), ("abc", "d")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=item, idx=i) for i, item in enumerate(items)]
    url = str(session._base_url.with_path("/v1/completions"))
    remote = LocalCompletionsAPI(model="tiny", base_url=url, tokenizer=str(tmp_path), tokenizer_backend="huggingface",
                                 num_concurrent=1, max_retries=1, batch_size=2)
    served = await asyncio.to_thread(remote.loglikelihood, requests, disable_tqdm=True)
    local = HFLM(pretrained=tiny_model("llama"), tokenizer=engine.tokenizer, batch_size=1, device="cpu")
    expected = local.loglikelihood(requests, disable_tqdm=True)
    for (got_lp, got_greedy), (want_lp, want_greedy), item in zip(served, expected, items, strict=True):
        assert abs(got_lp - want_lp) < 1e-4 * len(item[1]), item
        assert got_greedy == want_greedy, item
