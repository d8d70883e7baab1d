"""--moe-layer-freq's list forms: 0,1,1,1, [0,1,1,1] and Megatron-LM's list expressions
(`([0]*1+[1]*3)`), read without eval."""

from __future__ import annotations

import ast
from typing import Optional

MAX_PATTERN = 1 << 16  # a --moe-layer-freq list longer than this is refused, not built


def layer_freq_list(freq: str) -> Optional[list[int]]:
    """--moe-layer-freq as a list, one entry per layer (None: an integer N). Takes 0,1,1,1,
    [0,1,1,1] and Megatron-LM's list expressions: lists of integers joined by + and repeated
    by * an integer, `([0]*1+[1]*3)`, `([1]*3+[0])*2` (what Megatron-LM evaluates, without
    eval). Raises ValueError."""
    text = freq.strip()
    if "[" in text:
        try:
            return _list_expression(ast.parse(text, mode="eval").body)
        except SyntaxError:
            raise ValueError(text) from None
    if "," in text:
        return [int(item) for item in text.split(",") if item.strip()]
    return None


def _list_expression(node: ast.AST) -> list[int]:
    if isinstance(node, ast.List):
        return [_integer(item) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_expression(node.left) + _list_expression(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        items, times = ((node.left, node.right) if isinstance(node.right, ast.Constant)
                        else (node.right, node.left))
        items, times = _list_expression(items), _integer(times)
        if len(items) * times > MAX_PATTERN:
            raise ValueError(f"longer than {MAX_PATTERN} layers")
        return items * times
    raise ValueError(ast.dump(node))


def _integer(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        return node.value
    raise ValueError(ast.dump(node))
