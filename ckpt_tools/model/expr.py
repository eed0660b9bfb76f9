"""Tiny, safe expressions for tables: shapes, templates and conditions.

Tables write ``[n_heads * head_dim, hidden]``, ``model.layers.{num_layers + i}.`` or
``when: "attention_bias and l >= first_dense"``. Only arithmetic, comparisons,
boolean logic, conditional expressions and a few functions are allowed; names come
from the table's declared config variables plus loop indices.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
from collections.abc import Mapping
from functools import lru_cache

_MAX_LIST = 1 << 16


def _every(n: int, k: int, other: object, kth: object) -> list:
    """``n`` items: ``kth`` at every ``k``-th position (1-based), ``other`` elsewhere (e.g. layer types)."""
    if not (isinstance(n, int) and isinstance(k, int)) or not 0 <= n <= _MAX_LIST or k < 1:
        raise ValueError(f"every({n!r}, {k!r}, ...): need 0 <= n <= {_MAX_LIST} and k >= 1")
    return [kth if (i + 1) % k == 0 else other for i in range(n)]


_FUNCS = {
    "ceil_div": lambda a, b: -(-a // b),
    "every": _every,
    "min": min,
    "max": max,
    "len": len,
    "int": int,
    "ceil": math.ceil,
}

_ALLOWED = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.Name,
    ast.Constant, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Div, ast.Mod, ast.Pow, ast.USub,
    ast.UAdd, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In,
    ast.NotIn, ast.Subscript, ast.List, ast.Tuple,
)


class ExprError(ValueError):
    pass


@lru_cache(maxsize=4096)
def vet(text: str) -> tuple[ast.Expression | None, frozenset[str]]:
    """Parse and vet an expression: its syntax tree (None for a bare variable) and the variable names it uses.

    Loading the tables vets every expression of every table; compiling waits for ``evaluate`` (see
    ``_code``), so a run compiles only the expressions of the table it uses.
    """
    text = text.strip()
    if text.isascii() and text.isidentifier() and not keyword.iskeyword(text) and text not in _FUNCS:
        return None, frozenset({text})  # a bare variable, the commonest field: no parsing needed
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ExprError(f"cannot parse expression {text!r}: {e.msg}") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"expression {text!r} uses {type(node).__name__}, which tables may not use")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS or node.keywords:
                raise ExprError(f"expression {text!r}: only {sorted(_FUNCS)} may be called")
        elif isinstance(node, ast.Name) and node.id not in _FUNCS:
            names.add(node.id)
        elif isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool, type(None))):
            raise ExprError(f"expression {text!r} has an unsupported constant")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            raise ExprError(f"expression {text!r}: '**' is not allowed")
    return tree, frozenset(names)


@lru_cache(maxsize=4096)
def _code(text: str):
    """The compiled code of a vetted expression that is more than a bare variable (first evaluation only)."""
    tree, _ = vet(text)
    return compile(tree, "<table>", "eval")


def names_in(text: str) -> frozenset[str]:
    return vet(text)[1]


def evaluate(text: str | int | float | bool, env: Mapping[str, object]):
    """Evaluate a table expression; plain numbers pass through."""
    if isinstance(text, (int, float, bool)):
        return text
    tree, names = vet(text)
    missing = [n for n in names if n not in env]
    if missing:
        raise ExprError(f"expression {text!r} needs {', '.join(sorted(missing))}, which is not set")
    if tree is None:
        return env[next(iter(names))]
    try:
        return eval(_code(text), {"__builtins__": {}, **_FUNCS}, dict(env))  # noqa: S307 - vetted AST above
    except Exception as e:  # ZeroDivisionError, TypeError on None, ...
        raise ExprError(f"expression {text!r} failed: {e}") from None


_FIELD = re.compile(r"\{([^{}]+)\}")


def template_names(template: str) -> frozenset[str]:
    return frozenset(n for m in _FIELD.finditer(template) for n in names_in(m.group(1)))


def render(template: str, env: Mapping[str, object]) -> str:
    """Fill ``{expr}`` fields of a key template."""
    return _FIELD.sub(lambda m: _field(m.group(1), env), template)


def render_key(template: str, prefix: str, env: Mapping[str, object]) -> str:
    """A tensor key from its template: under ``prefix``, or from the root when the template starts with '/'
    (a tensor shared by every depth, or outside the layer's namespace)."""
    return render(template[1:], env) if template.startswith("/") else prefix + render(template, env)


def _field(text: str, env: Mapping[str, object]) -> str:
    if text in env and text.isidentifier():  # a bare variable ({e}, {l}, {i}): no parsing needed
        return str(env[text])
    return str(evaluate(text, env))
