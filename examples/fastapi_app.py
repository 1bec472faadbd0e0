"""A FastAPI app that owns an engine: server-sent events, a websocket that multiplexes
requests, Prometheus metrics, and one ordinary JSON route of its own.

    pip install 'acb[fastapi]'
    python examples/fastapi_app.py            # SmolLM2-135M-Instruct on http://127.0.0.1:8080
    python examples/fastapi_app.py --tiny     # a tiny random model (for tests)

    curl -N http://127.0.0.1:8080/generate \\
         -d '{"prompt": [{"role": "user", "content": "Name a cat breed."}], "max_new_tokens": 48}'
    curl http://127.0.0.1:8080/metrics

Each event is ``data: {"request_id", "text", "token_ids", "logprobs", "finish_reason"}``;
the last one has a ``finish_reason``. Closing the connection cancels the request and
frees its pages at once; SIGTERM lets running streams finish, then closes the engine.
"""

from __future__ import annotations

import argparse
import signal
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

import acb
from acb.integrations.starlette import engine_lifespan, metrics_route, sse_route, websocket_route

USAGE = """POST a JSON body to /generate and read the event stream, e.g.
curl -N http://HOST/generate -d '{"prompt": [{"role": "user", "content": "Hi!"}], "max_new_tokens": 48}'
Websocket: ws://HOST/ws ({"type": "generate", "id": 1, "prompt": "Hi"}); metrics: GET /metrics.
"""


class Question(BaseModel):
    question: str
    max_new_tokens: int = 48


def build_engine(tiny: bool) -> acb.Engine:
    if tiny:
        from acb.testing import tiny_engine

        return tiny_engine()
    from acb.loading import smollm2

    folder, gguf_file = smollm2()
    return acb.Engine.from_pretrained(folder, gguf_file=gguf_file)


def make_app(engine: acb.Engine) -> FastAPI:
    app = FastAPI(title="acb demo", lifespan=engine_lifespan(engine, drain_timeout=10.0))
    app.add_api_route("/generate", sse_route(), methods=["POST"])
    app.add_api_websocket_route("/ws", websocket_route())
    app.add_api_route("/metrics", metrics_route())

    @app.get("/", response_class=PlainTextResponse)
    async def usage(request: Request) -> str:
        return USAGE.replace("HOST", request.url.netloc)

    @app.post("/ask")
    async def ask(body: Question, request: Request) -> dict:
        """A whole answer as JSON: the engine from the lifespan, awaited like any coroutine."""
        done = await request.app.state.acb_engine.generate(
            [{"role": "user", "content": body.question}], max_new_tokens=body.max_new_tokens)
        return {"answer": done.text, "finish_reason": done.finish_reason, "ttft_s": done.metrics.ttft_s}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="serve a tiny random model instead of SmolLM2")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--graceful-timeout", type=float, default=10.0,
                        help="seconds SIGTERM lets running streams finish (default 10)")
    args = parser.parse_args()
    app = make_app(build_engine(args.tiny))
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the handler it
    # found: make that one exit with status 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.graceful_timeout)


if __name__ == "__main__":
    main()
