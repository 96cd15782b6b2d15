# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`mask-sum-rope`: text RoPE lengths taken from a mask's sum in rollout-engine code, while the prompt
embeddings are padded wider.

vLLM-omni's Qwen-Image pipelines in verl-omni computed `txt_seq_lens = prompt_embeds_mask.sum(dim=1).tolist()
if prompt_embeds_mask is not None else None` (the valid tokens) and built the engine's text RoPE table that
long, while the embeddings were padded wider; diffusers (the trainer) rotates every padded position. The fix
is the padded width: `[prompt_embeds.shape[1]] * batch`.

What counts: a text-length name (`txt_seq_lens`, `text_seq_len`, `encoder_seq_lens`, `prompt_seq_lens`: a
txt/text/encoder/prompt word plus `seq` and `len(s)`/`length(s)`) assigned (to a name, an attribute or a
subscript), passed as a keyword, given as a dict entry (`{"txt_seq_lens": ...}`), or returned by a function
so named, whose value is the sum of a mask (`<...mask...>.sum(...)`, `torch.sum(<mask>)`, `count_nonzero`) —
through `.tolist()`, `int()`/`list()`, a comprehension over it, `[x] * n`, either branch of a conditional
expression (`... if mask is not None else None`) or `a or b`, directly or through a name bound to one earlier
in the function — in code that runs in a rollout engine (`sides.engine_evidence`: a file, directory or class
named for vLLM/SGLang/rollout, or a file importing one). A single-process trainer that samples and trains
with the same diffusers transformer computes the same lengths on both sides (and diffusers' RoPE fails loudly
when they do not cover the embeddings), so there is nothing to disagree. A mask sum used otherwise (a slice
bound, a divisor for mean pooling, batch packing) is left alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .astutil import iter_statements, last_name, short, words
from .model import Hit
from .sides import engine_evidence
from .source import SourceFile

__all__ = ["RULE_ID", "check", "needs"]

RULE_ID = "mask-sum-rope"

_TEXT_WORDS = frozenset({"txt", "text", "encoder", "prompt"})
_LENGTH_WORDS = frozenset({"len", "lens", "length", "lengths"})
_COUNT_METHODS = frozenset({"sum", "count_nonzero"})
_CASTS = frozenset({"to", "long", "int", "bool", "float", "type", "detach", "cpu"})
_UNWRAP = frozenset(
    {"tolist", "cpu", "int", "long", "to", "detach", "numpy", "item", "squeeze", "flatten", "view", "reshape"}
)
_WRAPPERS = frozenset({"list", "tuple", "int"})
_ENGINE_NAMES = ("rollout", "vllm", "sglang")
_ENGINE_WORDS = tuple(word.encode() for word in _ENGINE_NAMES)


def needs(text: bytes, path: str) -> bool:
    """A text length, a mask, a sum, and a rollout engine named in the file or its path (both lower-cased)."""
    return (
        (b"seq_len" in text or b"seqlen" in text)
        and b"mask" in text
        and (b"sum(" in text or b"count_nonzero" in text)
        and (any(word in text for word in _ENGINE_WORDS) or any(word in path for word in _ENGINE_NAMES))
    )


def check(file: SourceFile) -> Iterator[Hit]:
    for scope in (file.tree, *file.functions):
        yield from _check_scope(file, scope)


def is_text_length_name(name: str | None) -> bool:
    parts = words(name)
    return bool(parts & _TEXT_WORDS and "seq" in parts and parts & _LENGTH_WORDS)


def _is_mask(node: ast.AST) -> bool:
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CASTS:
        node = node.func.value
    return "mask" in words(last_name(node))


def _is_mask_sum(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in _COUNT_METHODS and _is_mask(func.value):
        return True  # mask.sum(dim=1)
    return last_name(func) in _COUNT_METHODS and bool(node.args) and _is_mask(node.args[0])  # torch.sum(mask)


def _mask_sum(node: ast.AST, bound: dict[str, ast.AST]) -> ast.AST | None:
    """The mask sum that `node` *is* (up to `.tolist()`, `int(...)`, `[... for n in ...]`, `[x] * n`), or the
    one a name it is was bound to; None otherwise (a mask sum used as a slice bound or a divisor is not)."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _UNWRAP:
            if _is_mask_sum(node):
                return node
            node = node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _WRAPPERS:
            if len(node.args) != 1:
                return None
            node = node.args[0]
        elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            node = node.generators[0].iter
        elif isinstance(node, (ast.List, ast.Tuple)):
            return next((f for f in (_mask_sum(e, bound) for e in node.elts) if f is not None), None)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            return _mask_sum(node.left, bound) or _mask_sum(node.right, bound)
        elif isinstance(node, ast.IfExp):  # `mask.sum(dim=1).tolist() if mask is not None else None`
            return _mask_sum(node.body, bound) or _mask_sum(node.orelse, bound)
        elif isinstance(node, ast.BoolOp):
            return next((f for f in (_mask_sum(v, bound) for v in node.values) if f is not None), None)
        else:
            break
    if _is_mask_sum(node):
        return node
    if isinstance(node, ast.Name) and node.id in bound:
        return bound[node.id]
    return None


def _sinks(file: SourceFile, stmt: ast.stmt, scope: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """(value, what) pairs of this statement that must be a text RoPE length."""
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
        for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
            if is_text_length_name(last_name(target)):
                yield stmt.value, f"`{short(target, 30)}`"
                break
    if isinstance(stmt, ast.Return) and stmt.value is not None and is_text_length_name(getattr(scope, "name", "")):
        yield stmt.value, f"the return value of `{scope.name}`"
    for node in file.own_nodes(stmt):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if is_text_length_name(kw.arg):
                    yield kw.value, f"`{kw.arg}=`"
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and is_text_length_name(key.value):
                    yield value, f"`{key.value!r}` entry"


def _check_scope(file: SourceFile, scope: ast.AST) -> Iterator[Hit]:
    bound: dict[str, ast.AST] = {}
    for stmt, _ in iter_statements(scope.body):
        sunk = False
        for value, what in _sinks(file, stmt, scope):
            found = _mask_sum(value, bound)
            if found is None:
                continue
            sunk = True
            engine = engine_evidence(file, value)
            if engine is None:
                continue
            yield Hit(
                file,
                value,
                f"{what} comes from `{short(found, 50)}`, the valid tokens only, in rollout-engine code ({engine}): "
                "the engine builds its text RoPE table for fewer positions than the padded embeddings hold, while "
                "the trainer (diffusers) rotates the padded width; use the padded width: "
                "`txt_seq_lens = [prompt_embeds.shape[1]] * batch_size`",
            )
        if isinstance(stmt, ast.Assign) and not sunk:
            found = _mask_sum(stmt.value, bound)
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    if found is not None:
                        bound[target.id] = found
                    else:
                        bound.pop(target.id, None)
