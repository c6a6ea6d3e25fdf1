"""Built-in tools and the tool registry.

A tool is a class with a `schema` (an OpenAI-style function schema: name, description, JSON Schema
`parameters`) and `__call__(**arguments) -> str`; it is built once per environment with the
`env.tools` config (`ToolEnvConfig`). Register one with `@register_tool("name")`, or name a class
by import path (`"my_tools.py:Weather"`) in `env.tools.tools`.

- `calculator`: evaluates an arithmetic expression by walking its Python AST over an allow-list
  of nodes (numbers, + - * / // % **, unary signs, parentheses, a few math functions and
  constants); no `eval`, no names, attributes or calls outside the list, bounded powers and sizes.
- `search`: BM25 (rank-bm25's Okapi BM25) over a local document set (`env.tools.documents`: a
  JSONL file of `{"text", "title"?}` rows or a text file of blank-line separated passages).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from pathlib import Path
from typing import Any, Callable

from posttrain.utils.registry import registrar

TOOLS: dict[str, type] = {}
register_tool = registrar(TOOLS, "tool")


class ToolError(Exception):
    """A tool's own error message for the model (bad arguments, nothing found, ...)."""


# ---------------------------------------------------------------------------------------- calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log,
    "log10": math.log10, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
    "floor": math.floor, "ceil": math.ceil,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e300


def safe_eval(expression: str) -> float | int:
    """The value of an arithmetic expression (see the module docstring); raises ToolError when it
    is not one, or would be too large."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {e.msg}") from None

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if abs(node.value) > MAX_MAGNITUDE:
                raise ToolError("number too large")
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
            result = _BINARY[type(node.op)](left, right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            result = _UNARY[type(node.op)](value(node.operand))
        elif isinstance(node, ast.Name) and node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
              and not node.keywords and 0 < len(node.args) <= 8):
            result = _FUNCTIONS[node.func.id](*[value(a) for a in node.args])
        else:
            raise ToolError(f"unsupported syntax: {ast.unparse(node)[:60]!r} (numbers, + - * / // % **, "
                            f"parentheses, {', '.join(_FUNCTIONS)}, pi, e)")
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ToolError("result is too large or not a real number")
        return result

    try:
        return value(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError) as e:
        raise ToolError(f"math error: {e}") from None


def format_number(x: float | int) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x)


@register_tool("calculator")
class Calculator:
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression, e.g. (12.5 * 4) / 3 or sqrt(2) ** 2.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression."}},
                "required": ["expression"],
            },
        },
    }

    def __init__(self, cfg: Any = None):
        pass

    def __call__(self, expression: str) -> str:
        if not isinstance(expression, str):
            raise ToolError('"expression" must be a string')
        return format_number(safe_eval(expression))


# -------------------------------------------------------------------------------------------- search

_WORD = re.compile(r"\w+")


def tokenize_words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def load_documents(path: str | Path) -> list[dict]:
    """`{"title", "text"}` documents of a JSONL file (`text` required) or a text file (passages
    separated by blank lines); errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"env.tools.documents: no such file {str(path)!r}")
    docs = []
    if path.suffix == ".jsonl":
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{lineno}: a document needs a string 'text'")
            docs.append({"title": str(row.get("title", "")), "text": row["text"]})
    else:
        passages = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
        docs = [{"title": "", "text": p.strip()} for p in passages if p.strip()]
    if not docs:
        raise ValueError(f"env.tools.documents: {path} holds no documents")
    return docs


@register_tool("search")
class DocumentSearch:
    schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the document collection; returns the best matching passages.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "What to look for."}},
                "required": ["query"],
            },
        },
    }

    def __init__(self, cfg: Any):
        try:
            from rank_bm25 import BM25Okapi
        except ImportError:
            raise ImportError("the search tool needs the tools extra: pip install 'posttrain[tools]'") from None
        if cfg is None or not cfg.documents:
            raise ValueError("the search tool needs env.tools.documents (a .jsonl of {text, title} or a .txt file)")
        self.docs = load_documents(cfg.documents)
        self.top_k = cfg.search_top_k
        self.index = BM25Okapi([tokenize_words(d["title"] + " " + d["text"]) for d in self.docs])

    def __call__(self, query: str) -> str:
        if not isinstance(query, str) or not tokenize_words(query):
            raise ToolError('"query" must be a non-empty string')
        scores = self.index.get_scores(tokenize_words(query))
        ranked = sorted(range(len(self.docs)), key=lambda i: (-scores[i], i))[: self.top_k]
        ranked = [i for i in ranked if scores[i] > 0]
        if not ranked:
            return "No document matches."
        return "\n\n".join(
            f"[{n}] " + (f"{self.docs[i]['title']}: " if self.docs[i]["title"] else "") + self.docs[i]["text"]
            for n, i in enumerate(ranked, start=1)
        )
