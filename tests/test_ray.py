"""acb.integrations.ray: a local Ray Serve app of 2 tiny-model replicas (half a CPU
each), shared by every test of this module (Ray's start-up is the slow part)."""

import asyncio
import json
import os
import signal
import socket
import sys
import time

import aiohttp
import pytest

pytestmark = pytest.mark.extras
# Ray Serve is an extra (`bash scripts/setup.sh --extras`): without it the default run skips this
# module, and CI's extras run fails (tests/conftest.py)
ray = pytest.importorskip("ray", reason="Ray Serve is not installed: bash scripts/setup.sh --extras")
openai = pytest.importorskip("openai", reason="the openai client comes with acb[test]")
from ray import serve  # noqa: E402

import acb  # noqa: E402
from acb.integrations.ray import REPLICA_HEADER, FreePagesRouter, PrefixAwareRouter, build_app  # noqa: E402
from acb.integrations.ray_prefix import INDEX_NAMESPACE, index_name  # noqa: E402
from acb.testing import random_prompts, tiny_engine  # noqa: E402

APP = "acb"
CONFIG = acb.EngineConfig(num_blocks=64, page_size=8)
LONG = 400  # tokens: a stream that runs well past the test's reads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deploy(num_replicas: int) -> None:
    app = build_app(tiny_engine, num_replicas=num_replicas, engine_config=CONFIG,
                    ray_actor_options={"num_cpus": 0.5}, drain_timeout=20.0, request_router=FreePagesRouter,
                    enable_per_request_metrics=True)
    serve.run(app, name=APP, route_prefix="/")


@pytest.fixture(scope="module")
def url():
    # Build (or load) the native kernels here first, so the replicas only load them.
    asyncio.run(_reference([[1, 2, 3]], 2))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _deploy(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


async def _reference(prompts: list, max_tokens: int) -> list[str]:
    async with tiny_engine(config=CONFIG) as engine:
        done = await asyncio.gather(*(engine.generate(p, max_new_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True) for p in prompts))
    return [c.text for c in done]


async def _complete(session: aiohttp.ClientSession, url: str, prompt, max_tokens: int) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        assert answer["usage"]["completion_tokens"] == max_tokens
        return answer["choices"][0]["text"], resp.headers[REPLICA_HEADER]


async def _replica_metrics(session: aiohttp.ClientSession, url: str, replica: str) -> dict[str, float]:
    """One replica's /metrics (Serve routes each GET to some replica: ask until it is that one)."""
    for _ in range(200):
        async with session.get(f"{url}/metrics") as resp:
            if resp.headers[REPLICA_HEADER] == replica:
                text = await resp.text()
                return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                        if line and not line.startswith("#") and "{" not in line}
        await asyncio.sleep(0.05)
    raise AssertionError(f"replica {replica} never answered /metrics")


async def _open_stream(session: aiohttp.ClientSession, url: str, prompt, max_tokens: int):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await session.post(f"{url}/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    first = await resp.content.readline()
    assert first.startswith(b"data: "), first
    return resp


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[bool, int]:
    """(ended with [DONE], completion tokens from the usage chunk; 0 if none)."""
    done, tokens = False, 0
    try:
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                event = json.loads(line[6:])
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    except aiohttp.ClientError:
        pass
    finally:
        resp.release()
    return done, tokens


@pytest.mark.parametrize("kwargs, match", [
    ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}, "num_replicas or autoscaling_config"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"autoscaling_config": 4}, "autoscaling_config"),
    ({"drain_timeout": -1}, "drain_timeout"),
    ({"max_ongoing_requests": 0}, "max_ongoing_requests"),
    ({"log_interval": -1}, "log_interval"),
])
def test_build_app_names_the_bad_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_app(tiny_engine, **kwargs)
    with pytest.raises(TypeError, match="model must be"):
        build_app(42)


async def test_a_burst_is_answered_with_a_single_engines_tokens_over_both_replicas(url):
    prompts = random_prompts(16, 3, 12, seed=3)
    expected = await _reference(prompts, 12)
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(_complete(session, url, p, 12) for p in prompts))
    assert [text for text, _ in answers] == expected
    assert len({replica for _, replica in answers}) == 2  # both replicas served part of the burst


async def test_openai_client_streams_and_completes_against_the_ray_app(url):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    try:
        assert [m.id for m in (await client.models.list()).data] == ["acb"]
        messages = [{"role": "user", "content": "Hello"}]
        whole = await client.chat.completions.create(model="acb", messages=messages, max_tokens=8, temperature=0)
        stream = await client.chat.completions.create(model="acb", messages=messages, max_tokens=8, temperature=0,
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == whole.choices[0].message.content and whole.usage.completion_tokens >= 1
        # deployed with enable_per_request_metrics: every answer has its metrics object
        assert whole.model_extra["metrics"]["completion_tokens"] == whole.usage.completion_tokens
        with pytest.raises(openai.BadRequestError) as error:
            await client.completions.create(model="acb", prompt="x", max_tokens=0)
        assert error.value.body["param"] == "max_tokens"
    finally:
        await client.close()


def test_prefix_routing_needs_the_engines_kv_events():
    with pytest.raises(ValueError, match="kv_events=True"):
        build_app(tiny_engine, engine_config=CONFIG, request_router=PrefixAwareRouter)
    with pytest.raises(ValueError, match="request_router_kwargs"):
        build_app(tiny_engine, request_router_kwargs={"max_queue_gap": 4})


@pytest.mark.parametrize("flags, router", [([], None), (["--kv-events"], PrefixAwareRouter),
                                           (["--router", "prefix"], PrefixAwareRouter),
                                           (["--router", "free-pages"], FreePagesRouter)])
def test_acb_serve_ray_router_flags_reach_build_app(flags, router, monkeypatch, capsys):
    from acb.serving.cli import main

    seen = {}

    def capture(model, **kwargs):
        seen.update(kwargs)
        raise ValueError("captured")  # stop before Ray starts

    monkeypatch.setattr("acb.integrations.ray.build_app", capture)
    with pytest.raises(SystemExit):
        main(["serve", "--tiny", "--ray", "--port", "8000", *flags])
    assert "captured" in capsys.readouterr().err
    assert seen["request_router"] is router
    assert seen["engine_config"].kv_events == (router is PrefixAwareRouter)  # the prefix router reads them


@pytest.mark.parametrize("body, chat", [({"prompt": "Once upon a time"}, False),
                                        ({"prompt": [5, 6, 7, 8]}, False),
                                        ({"messages": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}]}, True)])
async def test_the_front_routes_on_the_token_ids_the_engine_runs(body, chat):
    from acb.integrations.openai_requests import Limits, parse_request, prompt_token_ids
    from acb.integrations.ray_prefix import _Tokenizing

    async with tiny_engine(config=CONFIG) as engine:
        parsed = parse_request({**body, "max_tokens": 1}, chat=chat, limits=Limits())
        engine_ids = prompt_token_ids(parsed, parsed.prompts[0], engine)
        front = _Tokenizing(engine.tokenizer, engine.vocab_size)  # what the front gets from a replica
        assert prompt_token_ids(parsed, parsed.prompts[0], front) == engine_ids
        assert (await engine.generate(engine_ids, max_new_tokens=1)).prompt_token_ids == engine_ids


async def _index_summary() -> dict:
    index = ray.get_actor(index_name(PREFIX_APP, "AcbDeployment"), namespace=INDEX_NAMESPACE)
    return await index.summary.remote()


async def _held_anywhere(prompt: list[int]) -> bool:
    index = ray.get_actor(index_name(PREFIX_APP, "AcbDeployment"), namespace=INDEX_NAMESPACE)
    held = await index.match.remote(prompt, list(await index.summary.remote()))
    return any(held.values())


PREFIX_APP = "acb-prefix"


@pytest.fixture(scope="module")
def prefix_url(url):
    """A second app on the same cluster: 2 replicas behind the prefix-aware router, at /prefix
    (deployed once for the module: ~50 s on two cores; its tests' prompts are their own)."""
    app = build_app(tiny_engine, num_replicas=2, engine_config=acb.EngineConfig(num_blocks=64, page_size=8,
                                                                                kv_events=True),
                    ray_actor_options={"num_cpus": 0.5}, request_router=PrefixAwareRouter,
                    request_router_kwargs={"max_queue_gap": 64},  # the 12 at once all go home, however they split
                    enable_per_request_metrics=True)
    serve.run(app, name=PREFIX_APP, route_prefix="/prefix")
    try:
        yield f"{url}/prefix"
    finally:
        serve.delete(PREFIX_APP)


async def test_requests_sharing_a_prefix_land_on_the_replica_that_caches_it(prefix_url):
    deadline = time.monotonic() + 120  # a bound on waiting for both replicas' first resync
    while sum(s["known"] for s in (await _index_summary()).values()) < 2:
        assert time.monotonic() < deadline, await _index_summary()
        await asyncio.sleep(0.1)
    docs = random_prompts(4, 40, 40, seed=11)  # 5 pages each
    questions = {d: [docs[d] + q for q in random_prompts(3, 4, 6, seed=20 + d)] for d in range(len(docs))}
    async with aiohttp.ClientSession() as session:
        home = {}
        for d, doc in enumerate(docs):
            async with session.post(f"{prefix_url}/v1/completions",
                                    json={"prompt": doc + [7], "max_tokens": 2, "ignore_eos": True}) as resp:
                assert resp.status == 200, await resp.text()
                home[d] = resp.headers[REPLICA_HEADER]
            while not await _held_anywhere(doc + [7]):  # its pages reach the index after its step
                await asyncio.sleep(0.05)
        asked = [(d, q) for i in range(3) for d, q in ((d, questions[d][i]) for d in range(len(docs)))]
        answers = await asyncio.gather(*(session.post(f"{prefix_url}/v1/completions", json={
            "prompt": q, "max_tokens": 2, "ignore_eos": True}) for _, q in asked))
        for (d, _), resp in zip(asked, answers):
            assert resp.status == 200, await resp.text()
            assert resp.headers[REPLICA_HEADER] == home[d], (d, home)
            # the replica had the document cached: 5 pages of 8 tokens came from it
            assert (await resp.json())["metrics"]["cached_prompt_tokens"] >= 40
            resp.release()
        # the front serves the other routes too, and errors keep their status
        async with session.get(f"{prefix_url}/v1/models") as resp:
            assert resp.status == 200 and REPLICA_HEADER in resp.headers
        async with session.post(f"{prefix_url}/v1/completions", json={"prompt": "x", "max_tokens": 0}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "max_tokens"
        async with session.get(f"{prefix_url}/v1/kv_events") as resp:
            assert resp.status == 404 and "prefix-aware router" in (await resp.json())["error"]["message"]
        resp = await _open_stream(session, prefix_url, docs[0] + [9], 6)
        assert resp.headers[REPLICA_HEADER] == home[0]
        assert await _read_stream(resp) == (True, 6)


async def test_a_disconnect_frees_the_pages_on_the_replica_that_served_it(url):
    async with aiohttp.ClientSession() as session:
        replicas = set()
        while len(replicas) < 2:
            async with session.get(f"{url}/health") as resp:
                replicas.add(resp.headers[REPLICA_HEADER])
        before = {r: await _replica_metrics(session, url, r) for r in replicas}
        resp = await _open_stream(session, url, "a long story", LONG)
        replica = resp.headers[REPLICA_HEADER]
        resp.close()  # the client goes away mid-stream
        for _ in range(600):
            stats = await _replica_metrics(session, url, replica)
            if stats["acb_requests_running"] == 0 and stats["acb_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
    assert stats["acb_kv_free_blocks"] == stats["acb_kv_total_blocks"]
    # Cancelled on its replica, not run to its end:
    assert stats["acb_generated_tokens_total"] - before[replica]["acb_generated_tokens_total"] < LONG


def _kill(replica: str) -> None:
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#AcbDeployment#{replica}", namespace="serve")
    ray.kill(actor, no_restart=True)


async def test_killing_a_replica_fails_only_its_requests_and_the_app_serves_again(url):
    async with aiohttp.ClientSession() as session:
        streams = {}
        for i in range(12):  # until both replicas run a stream
            resp = await _open_stream(session, url, f"story {i}", LONG)
            streams.setdefault(resp.headers[REPLICA_HEADER], []).append(resp)
            if len(streams) == 2 and i >= 3:
                break
        assert len(streams) == 2, streams.keys()
        victim, survivor = sorted(streams)
        _kill(victim)
        lost = await asyncio.gather(*(_read_stream(r) for r in streams[victim]))
        kept = await asyncio.gather(*(_read_stream(r) for r in streams[survivor]))
        assert all(not done for done, _ in lost)
        assert kept == [(True, LONG)] * len(streams[survivor])
        # Ray restarts the dead replica: requests are answered, by a new replica among them.
        seen: set[str] = set()
        deadline = time.monotonic() + 300  # a bound on waiting, not a speed check: the replica imports torch
        while not seen - {victim, survivor} and time.monotonic() < deadline:
            try:
                seen.add((await _complete(session, url, "again", 4))[1])
            except (AssertionError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.5)
        assert seen - {victim, survivor}, seen


async def test_scaling_down_lets_running_streams_finish(url):
    async with aiohttp.ClientSession() as session:
        streams = [await _open_stream(session, url, f"drain {i}", LONG) for i in range(4)]
        scale = asyncio.get_running_loop().run_in_executor(None, _deploy, 1)
        results = await asyncio.gather(*(_read_stream(r) for r in streams))
        await scale
        assert results == [(True, LONG)] * len(streams)
        await _complete(session, url, "after", 4)  # the remaining replica serves


async def test_embeddings_through_the_ray_app_and_its_prefix_routed_front(url, prefix_url):
    """POST /v1/embeddings on a replica (and through the prefix-routed app's front): a single engine's
    vectors, named in x-acb-replica; a refused field is the same 400."""
    texts = ["a cat sat", "a dog ran", "bread at home"]
    async with tiny_engine(config=CONFIG) as engine:
        want = await engine.embed(texts)
    async with aiohttp.ClientSession() as session:
        for base in (url, prefix_url):
            async with session.post(f"{base}/v1/embeddings", json={"model": "acb", "input": texts}) as resp:
                assert resp.status == 200 and resp.headers[REPLICA_HEADER], await resp.text()
                body = await resp.json()
            got = [d["embedding"] for d in body["data"]]
            assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) < 1e-5
            assert body["usage"]["prompt_tokens"] == sum(len(t) for t in texts)  # (the byte-level tokenizer)
            async with session.post(f"{base}/v1/embeddings", json={"input": "x", "dimensions": 8}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "dimensions"
                assert resp.headers[REPLICA_HEADER]  # an error names its replica too


async def test_anthropic_messages_and_openai_responses_through_the_ray_app_and_its_front(url, prefix_url):
    """The Anthropic and OpenAI SDKs against a replica's routes and the prefix-routed front:
    Messages (whole, streamed, count_tokens) and Responses (whole, streamed) answer as one engine
    does; a bad Messages body is a 400 in Anthropic's shape, a bad Responses body in OpenAI's."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    ask = [{"role": "user", "content": "hi there"}]
    texts = set()
    for base in (url, prefix_url):
        claude = anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0)
        greedy = {"temperature": 0}  # (the anthropic package no longer sends sampling fields: extra_body does)
        whole = await claude.messages.create(model="acb", max_tokens=8, messages=ask, extra_body=greedy)
        async with claude.messages.stream(model="acb", max_tokens=8, messages=ask, extra_body=greedy) as stream:
            final = await stream.get_final_message()
        assert whole.content[0].text == final.content[0].text and 1 <= whole.usage.output_tokens <= 8
        texts.add(whole.content[0].text)
        assert (await claude.messages.count_tokens(model="acb", messages=ask)).input_tokens > 0
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        answer = await client.responses.create(model="acb", input="hi there", max_output_tokens=8, temperature=0)
        events = [e async for e in await client.responses.create(model="acb", input="hi there", max_output_tokens=8,
                                                                 temperature=0, stream=True)]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v1/messages/count_tokens", json={"model": "acb", "messages": ask}) as resp:
                assert resp.status == 200 and resp.headers[REPLICA_HEADER]
            async with session.post(f"{base}/v1/messages", json={"model": "acb", "messages": ask}) as resp:
                assert resp.status == 400 and resp.headers[REPLICA_HEADER]
                body = await resp.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith("'max_tokens'"), body
            async with session.post(f"{base}/v1/responses", json={"input": "hi", "conversation": "c1"}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "conversation"
    assert len(texts) == 1  # a replica's answer and the front's: the same engine's greedy tokens


async def test_acb_serve_ray_serves_the_openai_routes_and_exits_0_on_sigint(url):
    """Last: the command's app takes the module's place on the same Ray cluster and port."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = await asyncio.create_subprocess_exec(
        # --kv-events: the prefix-aware app (front + engines publishing their events); build_app
        # without a router is the module's own app
        sys.executable, "-m", "acb.cli", "serve", "--tiny", "--ray", "--kv-events", "--num-blocks", "64",
        "--replica-cpus", "0.5",
        "--ray-address", ray.get_runtime_context().gcs_address, "--port", url.rsplit(":", 1)[1],
        "--log-interval", "0.5", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    stderr: list[bytes] = []

    async def collect() -> None:  # Ray forwards the replicas' stderr to the driver's
        async for err_line in proc.stderr:
            stderr.append(err_line)

    collector = asyncio.ensure_future(collect())
    try:
        while True:  # Ray may log to stdout first
            line = await asyncio.wait_for(proc.stdout.readline(), 300)
            assert line, "acb serve --ray exited before serving"
            if b"acb: serving" in line:
                break
        assert b"acb: serving 'acb-tiny'" in line, line
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "acb-tiny"
            async with session.get(f"{url}/v1/kv_events") as resp:  # the front's: the events feed the router
                assert resp.status == 404 and "prefix-aware router" in (await resp.json())["error"]["message"]
            # --log-interval reaches the replicas: a busy replica logs its throughput line
            for _ in range(100):
                await _complete(session, url, "log me", 64)
                if any(b"acb replica" in err_line and b"throughput:" in err_line for err_line in stderr):
                    break
            else:
                raise AssertionError("no replica logged a throughput line: " + b"".join(stderr[-20:]).decode())
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 120) == 0
    finally:
        collector.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
