"""Stream generations as server-sent events from an aiohttp app that owns an engine.

    python examples/sse_server.py            # SmolLM2-135M-Instruct on http://127.0.0.1:8080
    python examples/sse_server.py --tiny     # a tiny random model (for tests)

    curl -N http://127.0.0.1:8080/generate \\
         -d '{"prompt": [{"role": "user", "content": "Name a cat breed."}], "max_new_tokens": 48}'

Each event is ``data: {"request_id", "text", "token_ids", "logprobs", "finish_reason"}``;
the last one has a ``finish_reason``. Closing the connection cancels the request.
"""

from __future__ import annotations

import argparse

from aiohttp import web

import acb
from acb.integrations.aiohttp import setup_engine, sse_handler

USAGE = """POST a JSON body to /generate and read the event stream, e.g.
curl -N http://HOST/generate -d '{"prompt": [{"role": "user", "content": "Hi!"}], "max_new_tokens": 48}'
"""


def build_engine(tiny: bool) -> acb.Engine:
    if tiny:
        from acb.testing import tiny_engine

        return tiny_engine()
    from acb.loading import smollm2

    folder, gguf_file = smollm2()
    return acb.Engine.from_pretrained(folder, gguf_file=gguf_file)


def make_app(engine: acb.Engine) -> web.Application:
    app = web.Application(client_max_size=64 * 1024)
    setup_engine(app, engine, drain_timeout=10.0)  # started with the app, drained on shutdown
    app.router.add_post("/generate", sse_handler(engine))
    app.router.add_get("/", lambda request: web.Response(text=USAGE.replace("HOST", request.host)))
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--tiny", action="store_true", help="serve a tiny random model instead of SmolLM2")
    args = parser.parse_args()
    web.run_app(make_app(build_engine(args.tiny)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
