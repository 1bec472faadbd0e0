"""The ``acb`` command: ``acb serve --tiny`` as a real process, spoken to over HTTP; its engine
flags, generated from EngineConfig (acb.serving.engine_flags), and vLLM's --speculative-config."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import sys
from importlib.metadata import entry_points
from typing import Any

import aiohttp
import pytest
from http_helpers import acb_serve, free_port, sse_events

import acb
from acb.serving.cli import main


def test_console_script_points_at_main():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "acb"]
    assert script.value == "acb.cli:main"


@pytest.mark.parametrize("argv", [[], ["serve", "--port", "70000"], ["serve", "--tiny", "some/dir"],
                                  ["serve", "/no/such/model/dir"], ["serve", "--tiny", "--cpu-offload-space", "-1"],
                                  ["serve", "--tiny", "--num-replicas", "2"],  # Ray options need --ray
                                  ["serve", "--tiny", "--ray", "--port", "0"],
                                  ["serve", "--tiny", "--ray", "--target-queue-depth", "8"],
                                  ["serve", "--tiny", "--ray", "--num-replicas", "3", "--max-replicas", "2"],
                                  ["serve", "--tiny", "--ray", "--port", "8000", "--kv-events", "--router", "queue"],
                                  ["serve", "--tiny", "--router", "prefix"],  # needs --ray
                                  ["serve", "--tiny", "--ray", "--port", "8000", "--router", "nearest"],
                                  ["serve", "--ray", "/no/such/model/dir"]])
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: acb" in capsys.readouterr().err


def test_serve_options_reach_the_engine_config():
    from acb.serving.cli import _build_engine, build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--tiny", "--num-blocks", "40", "--cpu-offload-space", "0.001",
                              "--scheduler", "priority", "--priority-aging-steps", "7",
                              "--grammar-compile-timeout", "2.5"])
    engine, name = _build_engine(args, parser)
    assert name == "acb-tiny"
    assert engine.config.grammar_compile_timeout_s == 2.5
    stats = engine.stats()
    assert stats.total_blocks == 40 and stats.host_blocks > 0
    assert engine.scheduler.policy == "priority" and engine.scheduler.aging_steps == 7


def test_a_taken_port_exits_1_with_a_message(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--tiny", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.fixture
def server_log(tmp_path):
    with open(tmp_path / "server.log", "w") as log:
        yield log


# SIGTERM in the default suite; SIGINT (the same drain, another signal) in CI's extras step
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extras)])
async def test_serve_process_answers_then_drains_and_exits_0_on_signal(signum, server_log, tmp_path):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acb.cli", "serve", "--tiny", "--port", str(port), "--drain-timeout", "20",
        "--scheduler", "priority", "--kv-events", "--enable-per-request-metrics",
        stdout=asyncio.subprocess.PIPE, stderr=server_log, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert f"http://127.0.0.1:{port}" in ready.decode(), (tmp_path / "server.log").read_text()
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(base_url=url) as session:
            async with session.get("/health") as resp:
                assert resp.status == 200
            async with session.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True,
                                                             "priority": -1}) as resp:
                answer = await resp.json()
                assert answer["usage"]["completion_tokens"] == answer["metrics"]["completion_tokens"] == 4
            kv_events = await session.get("/v1/kv_events")  # never ends by itself: the engine's drain ends it
            assert json.loads((await anext(sse_events(kv_events)))[1])["resync"]
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "ignore_eos": True,
                    "stream": True}
            async with session.post("/v1/chat/completions", json=body) as resp:
                events = sse_events(resp)
                await anext(events)
                proc.send_signal(signum)  # mid-stream: the request must still finish
                rest = [data async for _, data in events]
            await asyncio.wait_for(kv_events.read(), 10)  # not after aiohttp's 25 s handler timeout
            kv_events.release()
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ---------------------------------------------------------------- engine settings, generated from EngineConfig
def _serve_parser():
    from acb.serving.cli import build_parser

    return build_parser().parse_args(["serve"]).command_parser


def test_every_engine_setting_has_a_flag_or_a_reason():
    """A new EngineConfig field gets its flag from the dataclass; one whose type no flag can
    hold must be listed in NOT_EXPOSED with the reason, and each flag has a help group and help."""
    from acb.serving.engine_flags import FIELD_GROUPS, NOT_EXPOSED, field_docs, unexposed_fields

    assert unexposed_fields(_serve_parser()) == []
    names = [f.name for f in dataclasses.fields(acb.EngineConfig)]
    assert sorted(FIELD_GROUPS) == sorted(n for n in names if n not in NOT_EXPOSED)  # a readable --help
    assert all(len(why) > 20 for why in NOT_EXPOSED.values()) and set(NOT_EXPOSED) <= set(names)
    docs = field_docs(acb.EngineConfig)
    assert [n for n in names if not docs.get(n)] == []  # each field's docstring is its flag's help


@dataclasses.dataclass(frozen=True)
class _GrownConfig(acb.EngineConfig):
    new_count: int = 3
    """A count a future engine might grow."""
    new_object: Any = None
    """A Python object: no flag can hold it."""


def test_the_coverage_check_fails_on_an_unexposed_field():
    """What the test above guards against: a field added without a flag (here one whose type
    no flag can hold) is named; a plain one gets its flag, help and all, by itself."""
    from acb.serving.engine_flags import add_engine_flags, unexposed_fields

    parser = argparse.ArgumentParser()
    add_engine_flags(parser, {}, config_cls=_GrownConfig)
    assert unexposed_fields(parser, _GrownConfig) == ["new_object"]
    assert parser.parse_args(["--new-count", "5"]).new_count == 5
    assert "a count a future engine might grow (default: 3)" in " ".join(parser.format_help().split())


def _flag_value(field: dataclasses.Field) -> tuple[list[str], Any]:
    """(argv, the value EngineConfig should get) setting ``field`` to something other than its default."""
    from acb.core.config import CHOICES
    from acb.serving.engine_flags import flag_name

    flag = flag_name(field.name)
    special = {"compile_level": 2, "varlen_compile_level": 1, "decode_compile_level": 1, "max_memory_percent": 0.25,
               "safety_margin": 0.1, "tensor_parallel_size": 2, "max_adapters": 2, "max_adapter_rank": 8,
               "grammar_compile_timeout_s": 2.5, "distributed_timeout_s": 9.5, "cpu_offload_space": 0.001,
               "prompt_lookup_min": 3, "speculative_method": "ngram"}
    if field.name == "draft_model":
        return ["--speculative-method", "draft", flag, "/models/draft"], "/models/draft"
    if field.name in special:
        return [flag, str(special[field.name])], special[field.name]
    if field.name in CHOICES:
        value = [c for c in CHOICES[field.name] if c != field.default][-1]
        return [flag, value], value
    if field.type in ("bool", "bool | None"):
        return ([f"--no-{flag[2:]}"], False) if field.default else ([flag], True)
    if field.type == "str | None":
        return [flag, "cpu"], "cpu"
    return [flag, "7"], 7


def test_every_flag_reaches_the_engine_config():
    from acb.serving.cli import _model_source
    from acb.serving.engine_flags import NOT_EXPOSED

    parser = _serve_parser()
    for field in dataclasses.fields(acb.EngineConfig):
        if field.name in NOT_EXPOSED:
            continue
        argv, value = _flag_value(field)
        config = _model_source(parser.parse_args(["--tiny", *argv]))[2]
        assert getattr(config, field.name) == value, (field.name, argv)


def test_none_and_zero_spell_the_unbounded_settings():
    from acb.serving.cli import _model_source

    parser = _serve_parser()
    config = _model_source(parser.parse_args(["--tiny", "--grammar-compile-timeout", "0", "--cpu-offload-space",
                                              "none", "--block-size", "4", "--no-enable-prefix-caching"]))[2]
    assert (config.grammar_compile_timeout_s, config.cpu_offload_space) == (None, None)
    assert (config.page_size, config.allow_prefix_sharing) == (4, False)


@pytest.mark.parametrize(("spec", "fields"), [
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
     {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 3},
     {"speculative_method": "draft", "draft_model": "/d", "num_speculative_tokens": 3}),
    ({"model": "/d"}, {"speculative_method": "draft", "draft_model": "/d"}),  # vLLM infers the method
    ({"model": "[ngram]", "num_speculative_tokens": 2}, {"speculative_method": "ngram", "num_speculative_tokens": 2}),
])
def test_speculative_config_takes_vllms_keys(spec, fields):
    from acb.serving.cli import _model_source

    config = _model_source(_serve_parser().parse_args(["--tiny", "--speculative-config", json.dumps(spec)]))[2]
    assert {name: getattr(config, name) for name in fields} == fields


@pytest.mark.parametrize(("spec", "named"), [
    ('{"method": "eagle", "model": "x"}', "'eagle'"), ('{"method": "ngram", "draft_tensor_parallel_size": 1}',
                                                     "'draft_tensor_parallel_size'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "'num_speculative_tokens' must be an int >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "'num_speculative_tokens' must be an int"),
    ('{"method": "ngram", "prompt_lookup_min": 5}', "'prompt_lookup_max' must be >="),
    ('{"method": "draft_model"}', "needs 'model'"), ('{"method": "ngram", "model": "/d"}', "'model'"),
    ('{"num_speculative_tokens": 4}', "needs 'method'"), ("[]", "JSON object"), ("{method: ngram}", "not JSON"),
])
def test_a_bad_speculative_config_is_a_usage_error_naming_the_key(spec, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--tiny", "--speculative-config", spec])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config" in err and named in err, err


def test_a_plain_flag_that_disagrees_with_the_speculative_config_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--tiny", "--num-speculative-tokens", "2", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert "--num-speculative-tokens 2 disagrees" in capsys.readouterr().err


def test_a_refused_setting_names_its_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--tiny", "--compile-level", "7"])
    assert "--compile-level must be an int in 0..3" in capsys.readouterr().err


def test_a_draft_folder_from_the_speculative_config_is_the_engines_draft(tmp_path):
    from acb.serving.cli import _build_engine
    from acb.testing import tiny_model, tiny_tokenizer

    tiny_model("llama", seed=1).save_pretrained(tmp_path / "draft")
    tiny_tokenizer().save_pretrained(tmp_path / "draft")
    parser = _serve_parser()
    spec = json.dumps({"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3})
    engine, _ = _build_engine(parser.parse_args(["--tiny", "--speculative-config", spec]), parser)
    assert (engine.config.speculative_method, engine.config.num_speculative_tokens) == ("draft", 3)
    assert engine.config.draft_model == str(tmp_path / "draft")


REPETITIVE = {"prompt": [17] * 10, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("flags", [["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
                                   ["--speculative-method", "ngram", "--num-speculative-tokens", "4",
                                    "--allow-unknown-model"]], ids=["speculative-config", "plain-flags"])
async def test_serve_speculates_as_its_flags_say(flags, server_log):
    """acb serve with n-gram speculation: a request whose output repeats itself gets
    proposals accepted, which /metrics shows; an unknown model is a 404 unless
    --allow-unknown-model."""
    async with acb_serve("--tiny", *flags, log=server_log) as (url, _), \
            aiohttp.ClientSession(base_url=url) as session:
        async with session.post("/v1/completions", json={**REPETITIVE, "model": "acb-tiny"}) as resp:
            assert resp.status == 200, await resp.text()
        async with session.get("/metrics") as resp:
            metrics = dict(line.split(" ") for line in (await resp.text()).splitlines()
                           if line.startswith("acb_spec_"))
        assert float(metrics["acb_spec_accepted_tokens_total"]) > 0, metrics
        async with session.post("/v1/completions", json={**REPETITIVE, "model": "placeholder"}) as resp:
            assert resp.status == (200 if "--allow-unknown-model" in flags else 404), await resp.text()
