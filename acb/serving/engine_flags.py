"""``acb serve``'s engine settings, generated from :class:`acb.EngineConfig`: one flag per
field, named after it (``max_batch_tokens`` -> ``--max-batch-tokens``; ``_s`` fields lose the
suffix: ``--grammar-compile-timeout SECONDS``), typed by its annotation, defaulting to its
default, its help the field's docstring, in the help group :data:`FIELD_GROUPS` gives it; and
vLLM's ``--speculative-config JSON`` beside the plain speculative flags.

A field gets its flag without anyone writing one; a field whose type no flag can hold (a
Python object) is in :data:`NOT_EXPOSED` with the reason, and tests/test_cli.py fails on a
field that has neither (:func:`unexposed_fields`).

Example::

    groups = {"cache": parser.add_argument_group("memory and KV cache"), ...}
    add_engine_flags(parser, groups)
    config = acb.EngineConfig(**engine_fields(parser.parse_args(argv), parser))
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any

from ..core.checks import is_int
from ..core.config import CHOICES, EngineConfig

# Each field's help group (the keys of acb.serving.cli.HELP_GROUPS).
FIELD_GROUPS: dict[str, str] = {
    **dict.fromkeys(("device", "dtype", "quantization"), "model"),
    **dict.fromkeys(("max_batch_tokens", "max_requests_per_batch", "scheduler", "priority_aging_steps",
                     "max_waiting_requests", "safety_margin", "async_batching", "max_embedding_tokens"),
                    "scheduling"),
    **dict.fromkeys(("page_size", "num_blocks", "max_memory_percent", "allow_prefix_sharing", "cpu_offload_space",
                     "kv_cache_dtype", "kv_events", "kv_disk_path", "kv_disk_space"), "cache"),
    **dict.fromkeys(("attn_backend", "max_blocks_per_request", "compile_level", "varlen_compile_level",
                     "decode_compile_level", "use_cuda_graph", "q_padding_interval_size",
                     "kv_padding_interval_size"), "kernels"),
    **dict.fromkeys(("cpu_kernels", "cpu_prepack", "cpu_fused_forward", "cpu_bf16_gemm"), "cpu"),
    **dict.fromkeys(("speculative_method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "draft_model"), "speculative"),
    **dict.fromkeys(("grammar_compile_timeout_s", "grammar_cache_size"), "structured"),
    **dict.fromkeys(("max_adapters", "max_adapter_rank"), "adapters"),
    **dict.fromkeys(("tensor_parallel_size", "distributed_timeout_s"), "distributed"),
    "debug_checks": "logging",
}

# The fields with no flag, each with the reason.
NOT_EXPOSED: dict[str, str] = {
    "fault_hook": "a Python callable run at each step stage, for fault injection in tests: no command-line value",
}


def _seconds_or_none(text: str) -> float | None:
    """A bound in seconds; 0 (or none) = no bound."""
    if text.strip().lower() == "none":
        return None
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0 = no bound), got {text}")
    return value or None


_seconds_or_none.__name__ = "seconds"

# What a flag does differently from the rule: another name or aliases (vLLM's, where it means
# the same), its own type, metavar, default (None where acb serve decides it) or help ending.
OVERRIDES: dict[str, dict[str, Any]] = {
    "page_size": {"aliases": ("--block-size",)},
    "max_batch_tokens": {"aliases": ("--max-num-batched-tokens",)},
    "max_requests_per_batch": {"aliases": ("--max-num-seqs",)},
    "allow_prefix_sharing": {"aliases": ("--enable-prefix-caching",)},
    "grammar_compile_timeout_s": {"type": _seconds_or_none, "help_default": "30; 0 = no bound"},
    "draft_model": {"type": str, "metavar": "PATH"},
    "kv_disk_path": {"metavar": "DIR"},
    "max_adapters": {"default": None, "help_default": "4, or the number of --adapter if more"},
    "max_adapter_rank": {"default": None, "help_default": "16, or the largest rank among --adapter if more"},
    "device": {"metavar": "DEVICE"},
}


def flag_name(field: str) -> str:
    """The flag of an EngineConfig field: ``max_batch_tokens`` -> ``--max-batch-tokens``,
    ``distributed_timeout_s`` -> ``--distributed-timeout``."""
    return "--" + field.removesuffix("_s").replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring (the string literal under it), whitespace collapsed} of a
    dataclass, read from its source; {} where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value(base: type, optional: bool) -> Callable[[str], Any]:
    """The argparse type of an int, float or str field (``none`` gives None where None is a value)."""

    def parse(text: str) -> Any:
        if optional and text.strip().lower() == "none":
            return None
        return base(text)

    parse.__name__ = {int: "int", float: "number"}.get(base, "value")
    return parse


def _annotation(hint: Any) -> tuple[type | None, bool]:
    """(int, float, str or bool, or None for another type; whether None is allowed)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = [a for a in args if a is not type(None)]
    base = kinds[0] if len(kinds) == 1 and kinds[0] in (int, float, str, bool) else None
    return base, len(kinds) < len(args)


def _help(field: str, doc: str, default: Any, override: dict[str, Any]) -> str:
    """The field's docstring as a flag's help: "None" read as the default (or as ``none``, the
    flag's spelling of it), the default said last, in the style of the hand-written flags."""
    text = (doc or field.replace("_", " ")).rstrip(".")
    word = text.split(" ", 1)[0]
    if word == "A" or word[1:].islower():  # "Tokens per ..." -> "tokens per ...", not "GiB" nor "KV"
        text = text[0].lower() + text[1:]
    if "help_default" in override:
        text = re.sub(r"\s*\((?:None|default): [^)]*\)", "", text) + f" (default: {override['help_default']})"
    elif default is None:
        text = text.replace("None: ", "default: ")
        if "default:" not in text:
            text += " (default: none)"
    else:
        text = re.sub(r"\bNone\b", "none", text)
        if isinstance(default, bool):
            text += f" (default: {'on' if default else 'off'})"
        elif "default:" not in text:
            text += f" (default: {default})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_engine_flags(parser: argparse.ArgumentParser, groups: dict[str, Any],
                     config_cls: type = EngineConfig) -> list[str]:
    """Add a flag for each field of ``config_cls`` (EngineConfig) to its group in ``groups``
    (``parser`` itself for a field :data:`FIELD_GROUPS` does not place), ``dest`` the field's
    name; returns the fields that got one."""
    docs, hints = field_docs(config_cls), typing.get_type_hints(config_cls)
    added = []
    for f in dataclasses.fields(config_cls):
        if f.name in NOT_EXPOSED:
            continue
        override = OVERRIDES.get(f.name, {})
        base, optional = _annotation(hints[f.name])
        if "type" in override:
            base = override["type"]
        if base is None:
            continue  # no flag can hold it: unexposed_fields names it
        default = override.get("default", f.default)
        names = [flag_name(f.name), *override.get("aliases", ())]
        kwargs: dict[str, Any] = {"dest": f.name, "default": default}
        if base is bool:
            kwargs["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        else:
            kwargs["type"] = base if base in (_seconds_or_none, str) else _value(base, optional)
            if f.name in CHOICES:
                kwargs["choices"] = CHOICES[f.name]
                kwargs["type"] = str
            elif f.name.endswith("_s"):
                kwargs["metavar"] = "SECONDS"
            elif "metavar" in override:
                kwargs["metavar"] = override["metavar"]
            else:
                kwargs["metavar"] = "N" if base is int else "X"
        action = groups.get(FIELD_GROUPS.get(f.name), parser).add_argument(*names, **kwargs)
        action.help = _help(f.name, docs.get(f.name, ""), default, override)  # (BooleanOptionalAction adds its own)
        added.append(f.name)
    return added


def unexposed_fields(parser: argparse.ArgumentParser, config_cls: type = EngineConfig) -> list[str]:
    """The fields of ``config_cls`` that have no flag in ``parser`` and are not in :data:`NOT_EXPOSED`."""
    dests = {action.dest for action in parser._actions}
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in dests and f.name not in NOT_EXPOSED]


# ------------------------------------------------------------------ --speculative-config
SPECULATIVE_KEYS = {"method": "speculative_method", "model": "draft_model", "num_speculative_tokens":
                    "num_speculative_tokens", "prompt_lookup_min": "prompt_lookup_min",
                    "prompt_lookup_max": "prompt_lookup_max"}  # vLLM's key -> EngineConfig's field
METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft"}  # vLLM's method -> acb's
_NGRAM_MODELS = (None, "ngram", "[ngram]")  # vLLM's older spelling of the n-gram method: model "[ngram]"


def speculative_config(text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON as EngineConfig fields, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4}`` or ``{"method": "draft_model", "model": "/path"}``;
    ``argparse.ArgumentTypeError`` naming the key that is wrong."""

    def bad(message: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"{message} (in {text})")

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise bad('must be a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    for key in spec:
        if key not in SPECULATIVE_KEYS:
            raise bad(f"unknown key {key!r}: acb reads {', '.join(SPECULATIVE_KEYS)}")
    method, model = spec.get("method"), spec.get("model")
    if method is None:
        if model is None:
            raise bad("needs 'method' (ngram or draft_model) or a draft 'model'")
        method = "ngram" if model in _NGRAM_MODELS else "draft_model"
    if not isinstance(method, str) or method not in METHODS:
        raise bad(f"'method' {method!r} is not one acb runs: ngram or draft_model")
    fields: dict[str, Any] = {"speculative_method": METHODS[method]}
    if fields["speculative_method"] == "draft":
        if not isinstance(model, str) or not model:
            raise bad(f"'method' {method!r} needs 'model': the draft model's folder, got {model!r}")
        fields["draft_model"] = model
    elif model not in _NGRAM_MODELS:
        raise bad(f"'model' {model!r} is for method 'draft_model', not {method!r}")
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if key in spec:
            if not is_int(spec[key]):
                raise bad(f"{key!r} must be an int, got {spec[key]!r}")
            fields[key] = spec[key]
    try:
        EngineConfig(**fields)
    except ValueError as e:  # a value out of range: named by its key
        keys = {field: key for key, field in SPECULATIVE_KEYS.items()}
        raise bad(re.sub(r"EngineConfig\.(\w+)", lambda m: repr(keys.get(m[1], m[1])), str(e))) from None
    return fields


def add_speculative_config(group: Any) -> None:
    group.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                       help='vLLM\'s speculative config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
                            '"model": "/path/to/draft"}\' (the same as the flags below)')


def engine_fields(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  config_cls: type = EngineConfig) -> dict[str, Any]:
    """The EngineConfig keyword arguments of parsed ``args``: every flag's value, then
    ``--speculative-config``'s (a plain flag given another value is a parser error)."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    for name, value in (getattr(args, "speculative_config", None) or {}).items():
        given = fields.get(name)
        if given != parser.get_default(name) and given != value:
            parser.error(f"{flag_name(name)} {given} disagrees with --speculative-config's {value!r}")
        fields[name] = value
    return fields


def flag_error(message: str) -> str:
    """An EngineConfig validation message with each field named as its flag."""
    return re.sub(r"EngineConfig\.(\w+)", lambda m: flag_name(m[1]) if m[1] not in NOT_EXPOSED else m[0], message)


__all__ = ["FIELD_GROUPS", "NOT_EXPOSED", "add_engine_flags", "add_speculative_config", "engine_fields",
           "field_docs", "flag_error", "flag_name", "speculative_config", "unexposed_fields"]
