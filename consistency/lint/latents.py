# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`low-precision-latents`: a sample whose log-prob was computed in float32, rounded to bf16/fp16 (or the
model's dtype) and then stored, returned or fed on, so the trainer re-scores a latent the rollout never scored.

verl-omni's SDE scheduler (before 5120aac9) computed `log_prob` from the float32 `prev_sample`, then returned
`prev_sample.to(model_output.dtype)`; Flow-GRPO's SD3 pipeline stores the float32 latents and carries the
rounded ones into the next step, whose log-prob then scores an input the trainer never sees. Inference code
does the same cast on purpose (diffusers' schedulers end with `prev_sample.to(model_output.dtype)`, its
pipelines restore the latents' dtype after each step): there no log-prob is computed, so nothing disagrees,
and nothing is reported.

The rule follows values through one function (statements in order; a loop's body twice, so what one
iteration leaves reaches the next):

* a sample is *scored* when a log-prob is computed from it: it is bound from a call that also yields a
  log-prob (`latents, log_prob, ... = sde_step_with_logprob(...)`, a call whose name says log-prob, a
  function of the same file that returns a scored sample, `out.prev_sample` of a step result whose
  `log_prob` is read), or it is read by an assignment to a log-prob name
  (`log_prob = -((prev_sample.detach() - mean) ** 2) ...`);
* a *rounded copy* is a cast of a scored sample to bf16/fp16 or a model dtype: `x.to(dtype)` (also
  `dtype=`, `x.to(device, dtype)`), `x.half()`, `x.bfloat16()`, `x.type(dtype)`, `x.type_as(y)` — not
  float32/float64, not the sample's own `latents.dtype`;
* it is reported where the rounded copy is *kept*: returned or yielded, stored (`.append`/`.extend`/
  `.insert`, a subscript or attribute), passed to a sampler step, or carried by the loop to its next
  iteration (a name the loop reads before it writes it). `.float()` does not undo the rounding.

A cast before the log-prob is computed (the rounded sample is the one scored and stored: consistent), a cast
that only feeds the transformer (`transformer(hidden_states=latents.to(dtype))`, `latent_model_input`), and
a cast whose result is dropped are not reported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .astutil import bound_names, iter_statements, last_name, own_nodes, short, words
from .imports import is_entry
from .model import Finding, span
from .precision import mixed_precision_settings, nearest_settings
from .readers import call_pattern, resolvable, unread_log_probs
from .source import SourceFile

__all__ = ["RULE_ID", "Candidate", "Facts", "compare", "is_log_prob_name", "log_prob_slots", "needs", "summarise"]

RULE_ID = "low-precision-latents"

_LOW = frozenset({"bfloat16", "float16", "half", "bf16", "fp16"})
_HIGH = frozenset({"float32", "float", "float64", "double", "fp32", "fp64"})
_SAMPLE_WORDS = frozenset({"latent", "latents", "sample", "samples"})
_NOT_SAMPLE_WORDS = frozenset({"mean", "std", "var", "variance", "sigma", "sigmas", "noise", "eps", "dtype", "model"})
_SAMPLE_NAMES = frozenset({"x", "z", "x_t", "xt", "z_t", "zt", "x_prev", "x_next", "prev_x", "next_x", "z_prev"})
#: methods whose result still holds the cast value (the rounding survives them)
_PASSTHROUGH = frozenset(
    {
        "to",
        "float",
        "double",
        "half",
        "bfloat16",
        "type",
        "type_as",
        "clone",
        "detach",
        "contiguous",
        "cpu",
        "cuda",
        "view",
        "reshape",
        "squeeze",
        "unsqueeze",
        "permute",
        "flatten",
        "requires_grad_",
    }
)
_STORE_METHODS = frozenset({"append", "extend", "insert", "add", "appendleft", "put", "put_nowait"})
_NOT_STEP_RECEIVERS = frozenset({"optimizer", "optim", "lr", "scaler", "ema", "opt"})
#: a call named `step`, or `*step*` with one of these words, is a sampler step (`sde_step_with_logprob`,
#: `scheduler_step`, `flux_step`); `train_step`, `optimizer.step` and `record_window_step` are not
_STEP_FUNCTION_WORDS = frozenset(
    {
        "sde",
        "ode",
        "scheduler",
        "logprob",
        "log",
        "denoise",
        "denoising",
        "euler",
        "flow",
        "sampler",
        "sample",
        "sampling",
        "diffusion",
        "flux",
        "sd3",
        "sdxl",
        "grpo",
        "dance",
        "ddim",
        "dpm",
        "previous",
    }
)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_CONTAINER_CALLS = frozenset({"dict", "tuple", "list", "stack", "cat", "concat", "concatenate"})
_CAST_TOKENS = (b".to(", b".half(", b".bfloat16(", b".type(", b".type_as(")

_FIX = "keep latents float32 and cast only a copy for the transformer forward"


def needs(text: bytes, path: str) -> bool:
    """A finding needs a log-prob and a cast in the file (`text` lower-cased)."""
    return (b"logp" in text or b"log_prob" in text) and any(token in text for token in _CAST_TOKENS)


@dataclass(frozen=True)
class _Cast:
    call: ast.Call
    dtype: str
    scored_at: ast.AST  # where the log-prob of the uncast sample was computed
    kind: str  # 'low' (bf16/fp16 written out) or 'model' (another tensor's dtype, a dtype variable)


@dataclass(frozen=True)
class _Scored:
    at: ast.AST  # the call or statement that computed the log-prob
    loop: ast.stmt | None  # the innermost loop it is in


@dataclass(frozen=True)
class Candidate:
    """A rounded scored sample that is kept, as plain data (the file's tree is dropped): reported unless the
    files linted with it show that it cannot disagree (`compare`)."""

    finding: Finding  # as reported when nothing else is known (its message without a precision note)
    suppressed: bool
    kind: str  # 'low' (bf16/fp16 written out) or 'model' (another tensor's dtype, a dtype variable)
    lead: str  # the message up to where a mixed-precision note goes
    rest: str  # the message after it
    function: str | None  # the enclosing function, when it returns its log-probs in a tuple
    log_prob_slots: tuple[int, ...]  # the positions of that function's returned tuples that hold a log-prob


@dataclass(frozen=True)
class Facts:
    path: str
    candidates: tuple[Candidate, ...]


def summarise(file: SourceFile) -> Facts:
    """The file's candidates: every rounded scored sample it keeps (`_Scope`)."""
    # Only scopes whose text names a log-prob can score a sample (a function that returns a scored sample
    # names one too): most functions of a file that does are skipped unwalked. Each scope is walked once, with
    # the functions of this file known so far to return a scored sample (a call to one scores what it binds);
    # when more are found, only the scopes that call one of them are walked again (no other walk can change).
    texts = {id(scope): file.text_of(scope) for scope in file.functions}
    scored_scopes = {id(scope) for scope in file.functions if _names_log_prob(texts[id(scope)])}
    returns_scored: set[str] = set()
    results: dict[int, dict[str, ast.AST]] = {}  # scope -> `_results_with_log_prob`, computed once
    walked: dict[int, tuple[ast.AST, _Scope]] = {}
    pending = [file.tree, *(scope for scope in file.functions if id(scope) in scored_scopes)]
    for attempt in range(3):  # the second pass sees the summaries of functions defined below their callers
        for scope in pending:
            walked[id(scope)] = (scope, _Scope(file, scope, set(returns_scored), results).walk())
        if attempt == 2:
            break  # the callers of what the second pass found, walked knowing it; no further summaries
        found = {
            scope.name
            for scope, walk in walked.values()
            if id(scope) in scored_scopes and walk.returns_a_scored_sample and isinstance(scope, _FUNCTIONS)
        }
        if found <= returns_scored:
            break
        calls = re.compile(r"\b(?:" + "|".join(sorted(found - returns_scored)) + r")\s*\(")
        returns_scored |= found
        pending = [file.tree, *(scope for scope in file.functions if calls.search(texts[id(scope)]))]
    candidates = []
    for scope, walk in walked.values():
        kept = walk.kept
        if not kept:
            continue
        function = scope.name if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if function is not None and not log_prob_leaves(scope):
            continue  # its log-probs die inside it: no trainer can read them
        slots = log_prob_slots(scope) if function is not None else ()
        for origin, sink in kept:
            lead, rest = _message(origin, sink)
            line, col, end_line, end_col = span(file, origin.call)
            candidates.append(
                Candidate(
                    finding=Finding(file.path, line, col, RULE_ID, lead + rest, end_line, end_col),
                    suppressed=file.is_suppressed(origin.call, RULE_ID),
                    kind=origin.kind,
                    lead=lead,
                    rest=rest,
                    function=function if slots else None,
                    log_prob_slots=slots,
                )
            )
    return Facts(file.path, tuple(candidates))


def compare(facts: Sequence[Facts], linted: Sequence[tuple[str, tuple[str, ...]]]) -> Iterator[Finding]:
    """The candidates of all files, less those the other linted files clear: a rounding to another tensor's
    dtype (or a dtype variable) where every visible mixed-precision setting is float32, and a function whose
    callers discard the log-probs it returns (no trainer reads them: nothing to disagree with)."""
    candidates = [c for file_facts in facts for c in file_facts.candidates if not c.suppressed]
    if not candidates:
        return
    slots = {(c.finding.path, c.function): c.log_prob_slots for c in candidates if c.function}
    slots = {key: value for key, value in slots.items() if resolvable(key[1])}
    # One read of every linted file (most were never parsed) for both questions: the mixed-precision settings,
    # and the files that call a sampler whose log-probs may go unread.
    want_settings = any(c.kind == "model" for c in candidates)
    calls = call_pattern({name for _, name in slots}) if slots else None
    settings: list = []
    naming: dict[str, bytes] = {}
    entries: list[str] = []  # scripts, and files computing log-probs: which samplers a program runs
    running: list[str] = []
    if want_settings or calls is not None:
        for path, _ in linted:
            data = _read(path)
            if want_settings:
                settings.extend(mixed_precision_settings(path, data))
            if calls is not None:
                if calls(data):
                    naming[path] = data
                if is_entry(path, data):
                    entries.append(path)
                if b"log_prob" in data or b"logprob" in data:
                    running.append(path)
    unread = unread_log_probs(slots, linted, naming, (entries, running)) if slots else set()
    for candidate in candidates:
        if (candidate.finding.path, candidate.function) in unread:
            continue
        note = ""
        nearest = nearest_settings(settings, candidate.finding.path) if candidate.kind == "model" else []
        if nearest:
            low = [s for s in nearest if s.low]
            if not low:
                continue  # every setting of this project keeps float32: the cast is to float32
            note = f" ({low[0].value} under mixed precision, {low[0].where})"
        finding = candidate.finding
        yield Finding(
            finding.path,
            finding.line,
            finding.col,
            RULE_ID,
            candidate.lead + note + candidate.rest,
            finding.end_line,
            finding.end_col,
        )


def log_prob_slots(function: ast.AST) -> tuple[int, ...]:
    """The positions of the tuples `function` returns that hold a log-prob (`return latents, all_log_probs`);
    none when a log-prob also leaves it another way — stored on an object (`child.log_prob = lp`) or in a
    container that is not itself a log-prob (`buffer["x"] = log_prob`), passed to a constructor
    (`TreeNode(latent, log_prob)`) — so that only its returned tuples can carry it to a trainer."""
    if _log_prob_escapes(function):
        return ()
    slots: set[int] = set()
    for stmt, _ in iter_statements(function.body):
        if isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Tuple):
            for index, element in enumerate(stmt.value.elts):
                if any(
                    isinstance(n, (ast.Name, ast.Attribute)) and is_log_prob_name(last_name(n))
                    for n in ast.walk(element)
                ):
                    slots.add(index)
    return tuple(sorted(slots))


def _names_log_prob(text: str) -> bool:
    lowered = text.lower()
    return "logp" in lowered or "log_prob" in lowered


def is_log_prob_name(name: str | None) -> bool:
    """`log_prob`, `all_log_probs`, `logprobs`, `old_logp`, `logProb` (what `needs` looks for, too)."""
    lowered = (name or "").lower()
    return "logp" in lowered or "log_prob" in lowered


def dtype_kind(node: ast.AST, receiver: str | None = None, float32_names: frozenset[str] = frozenset()) -> str | None:
    """'low' (bf16/fp16), 'model' (another tensor's or a model's dtype, a dtype variable: bf16/fp16 under mixed
    precision), 'high' (float32/64) or None (not a dtype, or the cast value's own: `latents.to(latents.dtype)`).

    `receiver`: the name of the value being cast; `float32_names`: names this scope bound to a float32 value
    (`sample = sample.float()`), whose `.dtype` is float32.
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return "low" if node.value in _LOW else "high" if node.value in _HIGH else None
    if isinstance(node, ast.Call):
        return "high" if last_name(node.func) == "get_default_dtype" else None
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return None
    name = last_name(node)
    if name in _LOW:
        return "low"
    if name in _HIGH:
        return "high"
    if isinstance(node, ast.Attribute) and node.attr == "dtype":
        owner = _strip(node.value)
        owner_name = owner.id if isinstance(owner, ast.Name) else last_name(owner)
        if owner_name in float32_names:
            return "high"
        # `latents.to(latents.dtype)`: its own dtype; `prev_sample.type(sample.dtype)`: the input's (fp16 under
        # mixed precision, while the step computed `prev_sample` in float32)
        return None if owner_name is not None and owner_name == receiver else "model"
    parts = words(name)
    if "dtype" in parts:
        return "high" if parts & {"float32", "fp32", "float64", "fp64"} else "model"
    return None


def _low_cast(call: ast.Call, float32_names: frozenset[str] = frozenset()) -> tuple[ast.expr, str, str] | None:
    """(the cast value, the dtype as shown, 'low' or 'model') for a down-cast call, else None."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in ("half", "bfloat16") and not call.args:
        return func.value, f"torch.{'float16' if func.attr == 'half' else 'bfloat16'}", "low"
    if func.attr in ("to", "type"):
        base = _strip(func.value)
        receiver = base.id if isinstance(base, ast.Name) else None
        candidates = [kw.value for kw in call.keywords if kw.arg == "dtype"] or list(call.args)
        for arg in candidates:
            kind = dtype_kind(arg, receiver, float32_names)
            if kind is not None:
                return (func.value, short(arg, 40), kind) if kind != "high" else None
        return None
    if func.attr == "type_as" and call.args:
        other = call.args[0]
        if words(last_name(other)) & _SAMPLE_WORDS:
            return None
        return func.value, f"{short(other, 30)}.dtype", "model"
    return None


def _is_float32_cast(value: ast.AST) -> bool:
    """`x.float()`, `x.to(torch.float32)`, `x.double()`: a value that holds float32 (or wider) from here on."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)):
        return False
    if value.func.attr in ("float", "double") and not value.args:
        return True
    if value.func.attr in ("to", "type"):
        candidates = [kw.value for kw in value.keywords if kw.arg == "dtype"] or list(value.args)
        return any(dtype_kind(arg) == "high" for arg in candidates)
    return False


def _strip(node: ast.AST) -> ast.AST:
    """`latents[:, 0].detach()` -> `latents`; `scheduler.step(...).prev_sample` -> the step call."""
    while True:
        if isinstance(node, ast.Subscript) or (
            isinstance(node, ast.Attribute) and node.attr == "prev_sample" and isinstance(node.value, ast.Call)
        ):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PASSTHROUGH:
            node = node.func.value
        else:
            return node


def _is_step_call(node: ast.AST) -> bool:
    """`scheduler.step(...)`, `sde_step_with_logprob(...)`, `scheduler_step(...)`: a sampler step."""
    if not isinstance(node, ast.Call):
        return False
    name = last_name(node.func)
    parts = words(name)
    if name != "step" and not ("step" in parts and parts & _STEP_FUNCTION_WORDS):
        return False
    receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
    return not (receiver is not None and words(last_name(receiver)) & _NOT_STEP_RECEIVERS)


def _is_scoring_call(node: ast.AST) -> bool:
    """A call whose name says it computes a log-prob (`sde_step_with_logprob`, `denoise_with_log_prob`)."""
    return isinstance(node, ast.Call) and is_log_prob_name(last_name(node.func))


def _is_sample_name(name: str | None) -> bool:
    parts = words(name)
    return name in _SAMPLE_NAMES or bool(parts & _SAMPLE_WORDS and not parts & _NOT_SAMPLE_WORDS)


def _callee_key(call: ast.Call) -> str | None:
    """`f(...)` -> 'f', `self.f(...)` -> 'f': the calls resolved to a function of the same file."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
        return func.attr
    return None


class _Scope:
    """One function (or the module's top level), walked statement by statement."""

    def __init__(
        self, file: SourceFile, scope: ast.AST, returns_scored: set[str], results: dict[int, dict[str, ast.AST]]
    ) -> None:
        self.file = file
        self.scope = scope
        self.returns_scored = returns_scored
        self.scored: dict[str, _Scored] = {}  # name -> where its current value was scored
        self.rounded: dict[str, _Cast] = {}  # name -> the rounded copy of a scored sample it holds
        self.float32: set[str] = set()  # names bound to a float32 value (`sample = sample.float()`)
        self.reported: set[int] = set()
        self.kept: list[tuple[_Cast, str]] = []  # (a rounded copy, where it is kept)
        self.returns_a_scored_sample = False
        if id(scope) not in results:
            results[id(scope)] = _results_with_log_prob(file, scope)
        self.results_with_log_prob = results[id(scope)]

    def walk(self) -> _Scope:
        """Walk the scope: `kept` holds the rounded copies it keeps, `returns_a_scored_sample` whether it returns
        a scored (unrounded) sample first."""
        self._block(self.scope.body, ())
        return self

    def _block(self, body: list[ast.stmt], loops: tuple[ast.stmt, ...]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # a scope of its own
            self._statement(stmt, loops)
            if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
                for _ in range(2):  # what one iteration leaves reaches the next
                    self._block(stmt.body, (*loops, stmt))
                self._block(stmt.orelse, loops)
                continue
            if isinstance(stmt, ast.If):  # each branch from the same state; after it, what either left
                before = (dict(self.scored), dict(self.rounded), set(self.float32))
                self._block(stmt.body, loops)
                after_body = (self.scored, self.rounded, self.float32)
                self.scored, self.rounded, self.float32 = before
                self._block(stmt.orelse, loops)
                self.scored = {**self.scored, **after_body[0]}
                self.rounded = {**self.rounded, **after_body[1]}
                self.float32 = self.float32 & after_body[2]  # float32 after the `if` only if on both branches
                continue
            for name, value in ast.iter_fields(stmt):
                if isinstance(value, list) and name != "targets":
                    for item in value:
                        if isinstance(item, ast.stmt):
                            self._block([item], loops)
                        elif isinstance(item, (ast.ExceptHandler, ast.match_case)):
                            self._block(item.body, loops)

    def _statement(self, stmt: ast.stmt, loops: tuple[ast.stmt, ...]) -> None:
        bound: dict[str, _Cast] = {}
        for node in self.file.own_nodes(stmt):
            origin = None
            if isinstance(node, ast.Call):
                cast = _low_cast(node, frozenset(self.float32))
                if cast is not None:
                    scored = self._scored_at(cast[0])
                    # Scored inside a loop the cast is not in: the loop's final result (decoded, not re-scored).
                    if scored is not None and (scored.loop is None or any(scored.loop is loop for loop in loops)):
                        origin = _Cast(node, cast[1], scored.at, cast[2])
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                origin = self.rounded.get(node.id)
            if origin is None:
                continue
            sink, names = self._follow(node, loops)
            for name in names:
                bound.setdefault(name, origin)
            if sink is not None and id(origin.call) not in self.reported:
                self.reported.add(id(origin.call))
                self.kept.append((origin, sink))
        if isinstance(stmt, ast.Return) and stmt.value is not None:
            first = stmt.value.elts[0] if isinstance(stmt.value, ast.Tuple) and stmt.value.elts else stmt.value
            first = _strip(first)
            if isinstance(first, ast.Name) and first.id in self.scored and first.id not in self.rounded:
                self.returns_a_scored_sample = True
        newly_scored = self._scores(stmt)
        float32 = isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _is_float32_cast(stmt.value)
        for target in _assigned_names(stmt):
            self.rounded.pop(target, None)
            self.scored.pop(target, None)
            self.float32.discard(target)
            if target in bound:
                self.rounded[target] = bound[target]
            elif float32:
                self.float32.add(target)
        for name, where in newly_scored.items():
            self.scored[name] = _Scored(where, loops[-1] if loops else None)
            self.rounded.pop(name, None)  # a rounded copy scored from here on is consistent with its log-prob

    def _scored_at(self, subject: ast.AST) -> _Scored | None:
        """Where the log-prob of the value `subject` holds was computed, if it was."""
        node = _strip(subject)
        if _is_scoring_call(node):
            return _Scored(node, None)
        if isinstance(node, ast.Name):
            return self.scored.get(node.id)
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "prev_sample"
            and isinstance(node.value, ast.Name)
            and node.value.id in self.results_with_log_prob
        ):
            return _Scored(self.results_with_log_prob[node.value.id], None)
        return None

    def _scores(self, stmt: ast.stmt) -> dict[str, ast.AST]:
        """The names whose value this statement scores (binds together with a log-prob, or reads to compute one)."""
        if isinstance(stmt, ast.AugAssign):
            targets, value = [stmt.target], stmt.value
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets, value = (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]), stmt.value
        else:
            return {}
        elements = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        log_prob_targets = [e for e in elements if is_log_prob_name(last_name(e))]
        source = _strip(value)
        first = elements[0] if elements else None
        first_name = first.id if isinstance(first, ast.Name) else None
        if isinstance(source, ast.Call) and first_name is not None and not is_log_prob_name(first_name):
            key = _callee_key(source)
            if log_prob_targets or _is_scoring_call(source) or (key is not None and key in self.returns_scored):
                return {first_name: source}  # `latents, log_prob, ... = sde_step_with_logprob(...)`
        if (
            isinstance(source, ast.Attribute)
            and source.attr == "prev_sample"
            and isinstance(source.value, ast.Name)
            and source.value.id in self.results_with_log_prob
            and first_name is not None
        ):
            return {first_name: self.results_with_log_prob[source.value.id]}
        if log_prob_targets and len(log_prob_targets) == len(elements):  # `log_prob = -((prev_sample - ...`
            return {
                n.id: stmt
                for n in ast.walk(value)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and _is_sample_name(n.id)
            }
        return {}

    def _follow(self, node: ast.AST, loops: tuple) -> tuple[str | None, list[str]]:
        """Where the value of `node` goes: (the sink phrase or None, the names it is bound to)."""
        parents = self.file.parents
        path = [node]
        while True:
            parent = parents.get(node)
            if parent is None:
                return None, []
            carried = (
                isinstance(parent, (ast.Tuple, ast.List, ast.Set, ast.Starred, ast.keyword))
                or (isinstance(parent, ast.Dict) and node in parent.values)
                or (isinstance(parent, ast.IfExp) and node is not parent.test)
                or (isinstance(parent, ast.Subscript) and node is parent.value)
            )
            if isinstance(parent, ast.Attribute) and parent.attr in _PASSTHROUGH:
                call = parents.get(parent)
                if isinstance(call, ast.Call) and call.func is parent:
                    node = call
                    path.append(node)
                    continue
            if isinstance(parent, ast.Call) and node is not parent.func and _is_container_call(parent):
                carried = True
            if not carried:
                break
            node = parent
            path.append(node)
        at = self._where(parent)
        if isinstance(parent, (ast.Return, ast.Yield, ast.YieldFrom)):
            return f"returned{at}", []
        if isinstance(parent, ast.Call) and node is not parent.func:
            func = parent.func
            if isinstance(func, ast.Attribute) and func.attr in _STORE_METHODS:
                return f"stored with `{short(func, 40)}(...)`{at}", []
            if _is_step_call(parent) or _is_scoring_call(parent):
                return f"fed to `{short(func, 40)}(...)`{at} as the sample it scores", []
            return None, []
        if isinstance(parent, (ast.Assign, ast.AnnAssign)) and node is parent.value:
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            names: list[str] = []
            for target in targets:
                for element in _matching_targets(target, path):
                    if isinstance(element, (ast.Subscript, ast.Attribute)):
                        return f"stored in `{short(element, 40)}`{at}", []
                    if isinstance(element, ast.Name):
                        names.append(element.id)
            for name in names:
                if loops and (_read_before_written(name, loops[-1]) or _passed_to_step(name, loops[-1])):
                    return f"carried to the next step as `{name}`{at}", names
            return None, names
        return None, []

    def _where(self, node: ast.AST) -> str:
        line = getattr(self.file.statement_of(node), "lineno", None)
        return f" (line {line})" if line is not None else ""


def _reads_log_prob(node: ast.AST, holding: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether `node` reads a log-prob (a log-prob name, or a name of `holding`; not a function named for one:
    `sde_step_with_logprob(...)` also returns the sample)."""
    nodes = list(ast.walk(node))
    called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
    return any(
        isinstance(n, (ast.Name, ast.Attribute))
        and isinstance(n.ctx, ast.Load)
        and id(n) not in called
        and (is_log_prob_name(last_name(n)) or (isinstance(n, ast.Name) and n.id in holding))
        for n in nodes
    )


def _is_local_log_prob(node: ast.AST) -> bool:
    """A local log-prob list or dict (`all_log_probs`, `all_log_probs[key]`), not `self.log_probs`."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Name) and is_log_prob_name(node.id)


def log_prob_leaves(function: ast.AST) -> bool:
    """Whether the log-probs `function` computes can reach anyone: returned (in a tuple or otherwise), yielded,
    or leaving another way (`_log_prob_escapes`). A sampler that computes them and keeps them to itself (its
    pipeline returns `image, all_latents`) hands no trainer a log-prob to disagree with."""
    if _log_prob_escapes(function):
        return True
    statements = [stmt for stmt, _ in iter_statements(function.body) if not isinstance(stmt, _SCOPES)]
    # names holding a log-prob: a log-prob's own, and what is built from one (`ret = (image, all_log_probs)`)
    holding: set[str] = set()
    for _ in range(3):
        before = len(holding)
        for stmt in statements:
            if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and stmt.value is not None:
                if _reads_log_prob(stmt.value, holding):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    holding.update(name for target in targets for name in bound_names(target))
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                func = stmt.value.func  # `ret.append(all_log_probs)`
                receiver = func.value if isinstance(func, ast.Attribute) else None
                if isinstance(receiver, ast.Name) and any(_reads_log_prob(a, holding) for a in stmt.value.args):
                    holding.add(receiver.id)
        if len(holding) == before:
            break
    for stmt in statements:
        for node in own_nodes(stmt):
            returned = isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)) and node.value is not None
            if returned and _reads_log_prob(node.value, holding):
                return True
    return False


def _log_prob_escapes(function: ast.AST) -> bool:
    """Whether a log-prob leaves `function` other than in its returned tuples (see `log_prob_slots`)."""
    for stmt, _ in iter_statements(function.body):
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and _reads_log_prob(stmt.value):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    if isinstance(element, (ast.Attribute, ast.Subscript)) and not _is_local_log_prob(element.value):
                        return True
        for node in ast.walk(stmt) if not isinstance(stmt, _SCOPES) else ():
            if not isinstance(node, ast.Call) or not any(
                _reads_log_prob(arg) for arg in [*node.args, *(kw.value for kw in node.keywords)]
            ):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in (*_STORE_METHODS, "update", "setdefault"):
                if not _is_local_log_prob(func.value):  # `buffer.log_probs.append(lp)`, not `all_log_probs.append`
                    return True
            elif (last_name(func) or "")[:1].isupper():
                return True  # `TreeNode(latent, log_prob)`, `SchedulerOutput(prev_sample, log_prob)`
            # else `torch.stack(log_probs)`, `torch.exp(log_prob - old)`: computing from it, not keeping it
    return False


def _message(origin: _Cast, sink: str) -> tuple[str, str]:
    """The finding's message, in two parts: a note on the mixed-precision setting goes between them."""
    scored = origin.scored_at
    if isinstance(scored, ast.Call):
        how = f"`{short(scored.func, 40)}(...)` at line {scored.lineno}"
    else:
        how = f"line {scored.lineno}"
    return (
        f"`{short(origin.call)}` rounds to {origin.dtype}",
        f" a sample whose log-prob was computed in float32 ({how}), and the rounded value is {sink}: the trainer "
        f"re-scores a latent the rollout never scored; {_FIX}",
    )


def _results_with_log_prob(file: SourceFile, scope: ast.AST) -> dict[str, ast.AST]:
    """Names bound from a step call whose log-prob is read (`out.log_prob`, `out["log_prob"]`) in the scope."""
    from_step: dict[str, ast.AST] = {}
    read: set[str] = set()
    for stmt, _ in iter_statements(scope.body):
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and _is_step_call(stmt.value)
        ):
            from_step[stmt.targets[0].id] = stmt.value
        for node in file.own_nodes(stmt):
            if (
                isinstance(node, (ast.Attribute, ast.Subscript))
                and isinstance(node.value, ast.Name)
                and is_log_prob_name(last_name(node))
            ):
                read.add(node.value.id)
    return {name: call for name, call in from_step.items() if name in read}


def _passed_to_step(name: str, loop: ast.stmt) -> bool:
    for node in ast.walk(loop):
        if _is_step_call(node) or _is_scoring_call(node):
            for arg in [*node.args, *(kw.value for kw in node.keywords)]:
                stripped = _strip(arg)
                if isinstance(stripped, ast.Name) and stripped.id == name:
                    return True
    return False


def _read_before_written(name: str, loop: ast.stmt) -> bool:
    """Whether the loop body reads `name` before it assigns it: a value carried from one iteration to the next
    (the loop's own target is rebound every iteration, so it is not)."""
    if isinstance(loop, (ast.For, ast.AsyncFor)) and name in bound_names(loop.target):
        return False
    for stmt, _ in iter_statements(loop.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        reads = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in own_nodes(stmt))
        if reads or (isinstance(stmt, ast.AugAssign) and name in bound_names(stmt.target)):
            return True
        if name in _assigned_names(stmt):
            return False
    return False


def _is_container_call(call: ast.Call) -> bool:
    name = last_name(call.func) or ""
    return name in _CONTAINER_CALLS or name[:1].isupper()


def _matching_targets(target: ast.AST, path: list[ast.AST]) -> list[ast.AST]:
    """The assignment targets a value reaches: element-wise for `a, b = x, y`."""
    if isinstance(target, (ast.Tuple, ast.List)) and len(path) >= 2:
        value = path[-1]
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            index = next((i for i, elt in enumerate(value.elts) if elt is path[-2]), None)
            if index is not None:
                return [target.elts[index]]
        return []
    return [target]


def _assigned_names(stmt: ast.stmt) -> list[str]:
    targets: list[ast.AST] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        targets = [stmt.target]
    return [name for target in targets for name in bound_names(target)]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""
