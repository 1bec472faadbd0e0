"""acb serve with LoRA adapters: ``model`` names an adapter (as in vLLM), ``/v1/models``
lists them, ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's bodies)
behind the API key, and ``acb serve --adapter NAME=PATH``."""

from __future__ import annotations

import aiohttp
import pytest
from http_helpers import running_app, sse_json

from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.cli import build_parser, main
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine, tiny_lora_model

KEY = {"Authorization": "Bearer k"}
PROMPT = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in (("a", 1), ("b", 2)):
        tiny_lora_model("llama", seed=seed).save_pretrained(root / name)
    return root


async def completion(session, model, **extra):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    async with session.post("/v1/completions", json=body, headers=KEY) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json() if not extra.get("stream") else await sse_json(resp)


async def test_model_names_an_adapter_and_endpoints_load_and_unload(folders):
    app = create_app(tiny_engine(), ServerConfig(model_name="tiny", api_key="k",
                                                 adapters=(("a", str(folders / "a")),)))
    async with running_app(app) as url, aiohttp.ClientSession(base_url=url) as session:
        engine = app[ENGINE_KEY]
        async with session.get("/v1/models", headers=KEY) as resp:
            cards = (await resp.json())["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("a", "tiny")]
        assert cards[1]["root"] == str(folders / "a")
        with_a = await completion(session, "a")
        assert with_a["model"] == "a"
        want = await engine.generate(PROMPT, adapter="a", max_new_tokens=8, temperature=0, ignore_eos=True)
        base = await engine.generate(PROMPT, max_new_tokens=8, temperature=0, ignore_eos=True)
        assert with_a["choices"][0]["text"] == want.text != base.text
        assert (await completion(session, "tiny"))["choices"][0]["text"] == base.text
        streamed = await completion(session, "a", stream=True)
        assert "".join(c["choices"][0]["text"] for c in streamed[:-1] if c["choices"]) == want.text

        load = {"lora_name": "b", "lora_path": str(folders / "b")}
        async with session.post("/v1/load_lora_adapter", json=load) as resp:
            assert resp.status == 401  # behind the API key
        async with session.post("/v1/load_lora_adapter", json=load, headers=KEY) as resp:
            assert resp.status == 200 and "'b'" in await resp.text()
        assert engine.adapters() == ["a", "b"]
        assert (await completion(session, "b"))["model"] == "b"
        for body, status, param in (({"lora_name": "b", "lora_path": str(folders / "b")}, 400, "lora_name"),
                                    ({"lora_name": "c", "lora_path": str(folders / "nope")}, 400, "lora_path"),
                                    ({"lora_name": "c"}, 400, "lora_path")):
            async with session.post("/v1/load_lora_adapter", json=body, headers=KEY) as resp:
                assert (resp.status, (await resp.json())["error"]["param"]) == (status, param), body
        async with session.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=KEY) as resp:
            assert resp.status == 200 and "removed" in await resp.text()
        async with session.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=KEY) as resp:
            assert resp.status == 404
        async with session.get("/v1/models/b", headers=KEY) as resp:
            assert resp.status == 404
        body = {"model": "b", "prompt": PROMPT, "max_tokens": 2}  # not answered by the base model
        async with session.post("/v1/completions", json=body, headers=KEY) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 404 and error["code"] == "model_not_found"
            assert error["message"].endswith("this server serves 'tiny', 'a'")
        assert engine.adapters() == ["a"]


@pytest.mark.parametrize("argv", [["serve", "--tiny", "--adapter", "no-equals"],
                                  ["serve", "--tiny", "--adapter", "x=/no/such/adapter"],
                                  ["serve", "--tiny", "--ray", "--port", "8000", "--adapter", "x=."]])
def test_bad_adapter_flags_exit_2(argv, capsys, folders):
    argv = [a.replace("x=.", f"x={folders / 'a'}") for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "--adapter" in capsys.readouterr().err


def test_serve_sizes_adapter_slots_for_its_start_up_adapters(folders, tmp_path):
    from acb.serving.cli import _model_source

    tiny_lora_model("llama", seed=5, r=32).save_pretrained(tmp_path / "big")
    parser = build_parser()
    args = parser.parse_args(["serve", "--tiny"] + [f"--adapter=a{i}={folders / 'a'}" for i in range(5)]
                             + [f"--adapter=big={tmp_path / 'big'}"])
    config = _model_source(args)[2]
    assert (config.max_adapters, config.max_adapter_rank) == (6, 32)
    config = _model_source(parser.parse_args(["serve", "--tiny"]))[2]
    assert (config.max_adapters, config.max_adapter_rank) == (4, 16)


def test_adapter_flags_are_parsed(folders):
    args = build_parser().parse_args(["serve", "--tiny", "--adapter", f"a={folders / 'a'}", "--adapter",
                                      f"b={folders / 'b'}", "--max-adapters", "2", "--max-adapter-rank", "8"])
    assert args.adapter == [("a", str(folders / "a")), ("b", str(folders / "b"))]
    assert (args.max_adapters, args.max_adapter_rank) == (2, 8)
