"""OpenAI function-tool schemas of Python tool functions, read from their source without importing it.

The chat template lists the tools (`apply_chat_template(..., tools=schemas)`), so the model sees
each tool's name, description and parameters. They come from the function's signature (names,
which are required, simple annotations) and its docstring (first paragraph: the description;
a Google-style `Args:` section: the parameters' descriptions, parsed by transformers' own
docstring parser). The source is parsed with `ast`: loading a tool module in the trainer
process would run its imports there, which the tool runner avoids by calling tools in children.
"""
from __future__ import annotations

import ast
from typing import Optional

from mrl.errors import UserError
from mrl.reward.function import source_file, split_ref

_JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "list": "array",
               "tuple": "array", "dict": "object"}


def _json_type(annotation: Optional[ast.expr]) -> Optional[str]:
    if annotation is None:
        return None
    text = ast.unparse(annotation).strip("'\"")
    base = text.split("[")[0].split(".")[-1]
    return _JSON_TYPES.get(base)


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    description, args, _ = parse_google_format_docstring(doc)
    return (description or "").strip(), dict(args or {})


def function_schema(ref: str) -> dict:
    """{"type": "function", "function": {name, description, parameters}} of `ref`
    ('file.py:function' or 'module:function')."""
    target, name = split_ref(ref)
    path = source_file(target)
    if path is None or not path.is_file():
        raise UserError(f"rollout.multi_turn.tools: {target!r} not found")
    fn = next((node for node in ast.parse(path.read_text(), str(path)).body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name), None)
    if fn is None:
        raise UserError(f"rollout.multi_turn.tools: {path} defines no function {name!r} at module level")
    description, arg_docs = _docstring_parts(ast.get_docstring(fn) or "")
    a = fn.args
    positional = a.posonlyargs + a.args
    required = [p.arg for p in positional[:len(positional) - len(a.defaults)]]
    required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    properties = {}
    for p in positional + a.kwonlyargs:
        prop = {}
        kind = _json_type(p.annotation)
        if kind:
            prop["type"] = kind
        if p.arg in arg_docs:
            prop["description"] = arg_docs[p.arg]
        properties[p.arg] = prop
    return {"type": "function", "function": {"name": name, "description": description or name,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}
