"""A chat page that streams answers over a websocket, from an aiohttp app that owns an engine.

    python examples/websocket_chat/app.py           # SmolLM2-135M-Instruct, open http://127.0.0.1:8080
    python examples/websocket_chat/app.py --tiny    # a tiny random model (for tests)

The page keeps the conversation and sends it as a chat prompt; the answer streams
in chunk by chunk, and "Stop" cancels it with a message on the same socket. Several
requests could share the socket: each message carries its request id. Opening
``/?prompt=Hello`` sends that prompt as soon as the socket is up.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aiohttp import web

import acb
from acb.integrations.aiohttp import setup_engine, websocket_handler

PAGE = Path(__file__).with_name("index.html")


def build_engine(tiny: bool) -> acb.Engine:
    if tiny:
        from acb.testing import tiny_engine

        return tiny_engine()
    from acb.loading import smollm2

    folder, gguf_file = smollm2()
    return acb.Engine.from_pretrained(folder, gguf_file=gguf_file)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(PAGE)


def make_app(engine: acb.Engine) -> web.Application:
    app = web.Application()
    setup_engine(app, engine, drain_timeout=10.0)  # started with the app; drained, sockets closed on shutdown
    app.router.add_get("/", index)
    app.router.add_get("/ws", websocket_handler(engine, max_requests_per_socket=4))
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="a websocket chat page over an acb engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--tiny", action="store_true", help="serve a tiny random model instead of SmolLM2")
    args = parser.parse_args()
    web.run_app(make_app(build_engine(args.tiny)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
