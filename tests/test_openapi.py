"""``GET /openapi.json`` (acb.integrations.openapi): served by ``acb serve``'s app, naming every
route and every field the parser knows, with the ranges the parser enforces (one table:
acb.integrations.openai_fields.SCALARS) and this server's limits. schemathesis fuzzes the
server from this document in CI's extras step (tests/test_fuzz.py)."""

from __future__ import annotations

import math

import aiohttp
import jsonschema
import pytest
from http_helpers import running_app
from openapi_spec_validator import validate

from acb.integrations.common import ApiError
from acb.integrations.openai_fields import CHAT_SCALARS, SCALARS
from acb.integrations.openai_requests import CHAT_FIELDS, COMPLETION_FIELDS, Limits, parse_request
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

CHAT = [{"role": "user", "content": "hi"}]


async def _document(**config) -> tuple[dict, dict]:
    app = create_app(tiny_engine(), ServerConfig(**config))
    async with running_app(app) as url, aiohttp.ClientSession(base_url=url) as session:
        async with session.get("/openapi.json") as resp:  # never behind the API key
            assert resp.status == 200
            doc = await resp.json()
        async with session.get("/v1/models") as resp:
            models = {"status": resp.status}
    return doc, models


async def test_the_document_names_every_route_the_app_serves_and_validates_as_openapi_3_1():
    doc, _ = await _document()
    assert doc["openapi"] == "3.1.0"
    validate(doc)  # the OpenAPI 3.1 specification's own schema (openapi-spec-validator)
    app = create_app(tiny_engine(), ServerConfig())
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    published = {(method, path) for path, item in doc["paths"].items() for method in item}
    assert served == published
    # every schema in it is a valid JSON Schema (2020-12, OpenAPI 3.1's dialect)
    for path, item in doc["paths"].items():
        for op in item.values():
            bodies = [op["requestBody"]["content"]["application/json"]["schema"]] if "requestBody" in op else []
            answers = [m["schema"] for r in op["responses"].values() for m in r.get("content", {}).values()]
            for schema in bodies + answers:
                jsonschema.Draft202012Validator.check_schema(schema)


async def test_every_known_field_is_published_with_the_servers_limits():
    doc, _ = await _document(max_tokens_limit=512)
    paths = doc["paths"]
    for path, fields in (("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == set(fields) and schema["additionalProperties"] is True
        assert schema["properties"]["max_tokens"]["maximum"] == 512 and schema["properties"]["n"]["maximum"] == 128
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["logprobs"]["type"] == ["boolean", "null"]  # the completions route's: an integer
    assert chat["required"] == ["messages"]


async def test_with_an_api_key_the_v1_routes_name_bearer_auth_and_the_document_stays_open():
    doc, models = await _document(api_key="k")
    validate(doc)
    assert models["status"] == 401
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    for path, item in doc["paths"].items():
        for op in item.values():
            assert ("security" in op) == path.startswith("/v1/"), path
            if path.startswith("/v1/"):
                assert "401" in op["responses"]


def _parses(name: str, value, chat: bool) -> bool:
    body = {"messages": CHAT} if chat else {"prompt": "hi"}
    if name in ("top_logprobs",):
        body["logprobs"] = True
    if name == "best_of" and isinstance(value, int) and value >= 1:
        body["n"] = value  # (best_of must equal n)
    if name == "max_tokens" and not chat and value == 0:
        body["echo"] = True
    try:
        parse_request({**body, name: value}, chat=chat, limits=Limits(max_tokens_limit=10**9, max_n=10**9))
    except ApiError as e:
        assert e.status == 400 and e.param == name, (name, value, e.message)
        return False
    return True


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_each_published_range_is_the_one_the_parser_enforces(chat):
    """For every scalar field: null and its published bounds (a boolean's one honoured value) are
    accepted and a step past either is a 400 naming it; a value of another type is refused too."""
    for name, spec in (CHAT_SCALARS if chat else SCALARS).items():
        if name not in (CHAT_FIELDS if chat else COMPLETION_FIELDS) or name in ("continue_final_message",
                                                                                  "add_generation_prompt"):
            continue  # (these two may not both be true: tests/test_openai_fields.py)
        assert _parses(name, None, chat), name  # null: unset, as the document says
        if spec.type == "boolean":
            for value in (True, False):
                assert _parses(name, value, chat) == (spec.only in (None, value)), (name, value)
            assert not _parses(name, 1, chat), name
            continue
        step = 1 if spec.type == "integer" else 1e-6
        if spec.lo is not None:
            low = spec.lo if not spec.open_low else spec.lo + step
            assert _parses(name, low, chat), (name, low)
            assert not _parses(name, spec.lo - step if not spec.open_low else spec.lo, chat), name
        if spec.hi is not None and spec.hi != math.inf:
            assert _parses(name, spec.hi, chat), (name, spec.hi)
            assert not _parses(name, spec.hi + step, chat), name
        assert not _parses(name, "1", chat), name
