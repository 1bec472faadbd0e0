"""What ``acb serve`` and ``acb run-batch`` share: the model a command line names, built into an engine,
and the help groups their flags fall into."""

from __future__ import annotations

import argparse
import os

SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _adapter_rank(folder: str) -> int:
    """The rank ``r`` a PEFT adapter folder's config names (0 if it names none: load_adapter will say)."""
    import json

    with open(os.path.join(folder, "adapter_config.json")) as f:
        rank = json.load(f).get("r", 0)
    return rank if isinstance(rank, int) else 0


# The help groups of `acb serve --help`, in order (the engine settings' flags join theirs:
# acb.serving.engine_flags.FIELD_GROUPS)
HELP_GROUPS = {
    "model": "model",
    "server": "server",
    "requests": "requests (the OpenAI API's limits and defaults)",
    "scheduling": "scheduling",
    "cache": "memory and KV cache",
    "kernels": "attention, torch.compile and CUDA graphs",
    "cpu": "CPU kernels (each on by default; --no-... turns one off, for A/B measurements and bisecting)",
    "speculative": "speculative decoding (docs/speculative.md)",
    "structured": "structured outputs",
    "adapters": "LoRA adapters (docs/adapters.md)",
    "distributed": "tensor parallel (docs/distributed.md)",
    "ray": "Ray Serve (pip install 'acb[ray]'; see docs/scale-out.md)",
    "logging": "logging and debugging",
}


def _model_source(args: argparse.Namespace):
    """(model folder/file or engine factory, gguf_file, EngineConfig, default model name);
    a setting EngineConfig refuses is a parser error naming its flag."""
    import acb

    from .engine_flags import engine_fields, flag_error

    parser = args.command_parser
    fields = engine_fields(args, parser)
    if fields["max_adapters"] is None:  # room for the start-up adapters, whatever their number and rank
        fields["max_adapters"] = max(4, len(args.adapter))
    if fields["max_adapter_rank"] is None:
        fields["max_adapter_rank"] = max([16, *(_adapter_rank(path) for _, path in args.adapter)])
    if args.tiny:
        fields["page_size"] = fields["page_size"] or 8
        fields["num_blocks"] = fields["num_blocks"] or 256
    try:
        config = acb.EngineConfig(**fields)
    except ValueError as e:
        parser.error(flag_error(str(e)))
    if args.tiny:
        from acb.testing import tiny_engine

        return tiny_engine, None, config, "acb-tiny"
    if args.model_dir is None:
        from acb.model.loading import smollm2

        folder, gguf_file = smollm2()
        return folder, gguf_file, config, SMOLLM2_NAME
    name = os.path.basename(os.path.normpath(args.gguf_file or args.model_dir))
    return args.model_dir, args.gguf_file, config, name.removesuffix(".gguf")


def _build_engine(args: argparse.Namespace, parser: argparse.ArgumentParser):
    import acb

    try:
        source, gguf_file, config, name = _model_source(args)
        if callable(source):
            return source(config=config), name
        return acb.Engine.from_pretrained(source, gguf_file=gguf_file, config=config), name
    except (ValueError, FileNotFoundError, OSError) as e:
        parser.error(str(e))
