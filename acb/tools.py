"""Tool calls (public path): OpenAI's ``tools`` checked, forced and parsed. The code lives in
:mod:`acb.core.tools` (the request side), :mod:`acb.core.tool_parsers` (the parsers) and
:mod:`acb.engine.tool_calls` (``generate_with_tools``, ``stream_with_tools``); this module is
their public name (``acb.tools.get_parser``)."""

from .core.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolParser,
    ToolStream,
    get_parser,
    parser_for_template,
    template_supports_tools,
)
from .core.tools import check_tools, find_tool, generic_messages, generic_schema, named_schema, required_schema
from .engine.tool_calls import ToolCompletion, ToolDelta, generate_with_tools, stream_with_tools

# the three modules' __all__ (tests/test_import_contract.py checks that they agree)
__all__ = ["PARSERS", "ToolCall", "ToolCompletion", "ToolDelta", "ToolParser", "ToolStream", "check_tools",
           "find_tool", "generate_with_tools", "generic_messages", "generic_schema", "get_parser", "named_schema",
           "parser_for_template", "required_schema", "stream_with_tools", "template_supports_tools"]
