# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`non-launcher-seed`: an SDE window drawn from the rank, the process, a request's id, the clock or an
unseeded / globally seeded RNG instead of the launcher's arguments.

The SDE window (the denoising steps that get noise and log-probs) must be the same for every rollout of a
prompt group, whatever rank, process or request drew it: the group's rewards are compared with each other.
verl-omni's BAGEL adapter seeds it with `int(os.environ["LOCAL_RANK"])` (and, at fe48aeee, with a digest of the
request's id); Flow-GRPO style pipelines call `random.seed(process_index)` and then `random.randint(...)`. A seed that only diversifies sampling (a
per-device `set_seed(seed, device_specific=True)`, `seed + rank` for noise or mini-batch shuffling) is left
alone: the noise is stored with the trajectory and read back by the trainer, so nothing has to be reproduced.

*Where a window is made* (the sinks), within one function of a file that names the SDE or a noise level
(a profiler's or an attention's window is not an SDE window):
* an assignment to a name, attribute or string key with a `window` word (`sde_window`, `window_start`,
  `batch["sde_window"]`), or to `start`/`begin`/`offset`/`end` when the value or the enclosing function
  mentions a window or the SDE;
* a name that gates the noise in the denoising loop: compared with the loop's index in an `if` whose branches
  set a noise level or an SDE switch (`if i == random_timestep: cur_noise_level = noise_level`);
* a keyword argument with a `window` word (`sde_window=`), the seed of a call whose name has one
  (`_pick_sde_window(seed=...)`: a keyword with a seed/rng/generator word; which prompt groups a rank holds,
  `windows_for(groups=mine)`, does not seed anything), and what a function with a `window` word in its name
  returns.

*Where it must not come from* (the sources; also through names bound to them earlier in the scope, and
through generators seeded with them): `os.environ[...]`/`os.getenv(...)` of RANK, LOCAL_RANK, NODE_RANK,
WORLD_SIZE, SLURM_PROCID and kin; `*.get_rank()` and kin; `.process_index`, `.local_process_index`,
`.local_rank`, `.global_rank`, `.rank` and names `rank`, `local_rank`, `global_rank`, `node_rank`,
`dp_rank`, `process_index`; `os.getpid()`; a request's id (`request_id`, `req.request_id`, `getattr(req,
"request_id")`: each rollout of a group has its own, digested or not); builtin `hash()` (str hashes are salted
per process) and `id()`;
the clock (for a seed; `start = time.perf_counter()` is timing); `uuid`; OS entropy; draws from the global
`random` / `numpy.random` / torch generators (unless this function seeded them from launcher arguments
first; seeded from a rank, the draw comes from that rank); `torch.rand*` without `generator=`; draws from a
`random.Random()` / `np.random.default_rng()` / `torch.Generator` built without a seed or seeded from one of
these.

The finding is reported where the rank, process, clock or id is read (or the unseeded generator is made),
and names the window it reaches; a suppression comment there or on the window's line silences it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from .astutil import (
    bound_names,
    call_name,
    const,
    dotted,
    identifiers,
    keyword,
    last_name,
    nodes_in_order,
    short,
    words,
)
from .model import Hit
from .source import SourceFile

__all__ = ["RULE_ID", "check", "needs"]

RULE_ID = "non-launcher-seed"

_RANK_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "NODE_RANK",
        "GROUP_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "PMI_RANK",
        "JOB_COMPLETION_INDEX",
    }
)
_RANK_NAME = re.compile(r"^(?:local_|global_|node_|world_|dp_|sp_|tp_|pp_|data_parallel_)?rank(?:_id)?$")
_RANK_ATTRS = frozenset({"process_index", "local_process_index", "local_rank", "global_rank", "node_rank", "rank"})
_RANK_CALL = re.compile(r"^get_(?:\w+_)?(?:rank|ordinal)$")
_PY_DRAWS = frozenset(
    {
        "random",
        "randint",
        "randrange",
        "choice",
        "choices",
        "uniform",
        "sample",
        "shuffle",
        "getrandbits",
        "gauss",
        "normalvariate",
        "triangular",
        "betavariate",
        "expovariate",
        "randbytes",
    }
)
_NUMPY_NOT_DRAWS = frozenset(
    {
        "default_rng",
        "Generator",
        "RandomState",
        "SeedSequence",
        "seed",
        "get_state",
        "set_state",
        "PCG64",
        "PCG64DXSM",
        "MT19937",
        "Philox",
        "SFC64",
        "BitGenerator",
    }
)
_TORCH_DRAWS = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "normal",
        "bernoulli",
        "multinomial",
        "poisson",
    }
)
_CLOCK = frozenset(
    {
        "time.time",
        "time.time_ns",
        "time.perf_counter",
        "time.perf_counter_ns",
        "time.monotonic",
        "time.monotonic_ns",
        "datetime.datetime.now",
        "datetime.datetime.utcnow",
        "datetime.now",
    }
)
_ENTROPY = frozenset({"os.urandom", "uuid.uuid1", "uuid.uuid4"})
_UNSEEDED_CONSTRUCTORS = frozenset(
    {"random.Random", "random.SystemRandom", "numpy.random.default_rng", "numpy.random.RandomState"}
)
_RNG_CONSTRUCTORS = frozenset({"Random", "default_rng", "RandomState", "Generator", "SeedSequence"})
#: seeding functions of the global generators -> the generators they seed
_GLOBAL_SEEDERS = {
    "random.seed": ("random",),
    "numpy.random.seed": ("numpy",),
    "torch.manual_seed": ("torch",),
    "torch.random.manual_seed": ("torch",),
    "set_seed": ("random", "numpy", "torch"),  # accelerate, transformers
    "seed_everything": ("random", "numpy", "torch"),  # lightning
}
_GLOBAL_MODULES = frozenset({"torch", "random", "np", "numpy"})  # `torch.manual_seed(x)`: a global generator
_WINDOW_WORDS = frozenset({"window", "windows"})
_REQUEST_ID_WORDS = frozenset({"request", "id"})
_SEED_ARGUMENT_WORDS = frozenset({"seed", "seeds", "rng", "generator", "random"})
_START_WORDS = frozenset({"start", "begin", "offset", "end"})
_SDE_WORDS = frozenset({"window", "windows", "sde"})
_NOISE_LEVEL_WORDS = frozenset({"noise", "level"})

#: lower-cased words without which no window and no source can be found (`needs`)
_SDE_TOKENS = (b"sde", b"noise_level", b"noiselevel")
_SINK_TOKENS = (b"window", b"sde", b"noise_level", b"noiselevel")
_SINK_TEXT = tuple(token.decode() for token in _SINK_TOKENS)
_SDE_TEXT = tuple(token.decode() for token in _SDE_TOKENS)
_SOURCE_TOKENS = (
    b"rank",
    b"rand",
    b"process_index",
    b"getpid",
    b"hash(",
    b"id(",
    b"time",
    b"uuid",
    b"secrets",
    b"slurm",
)
_FIX = "derive SDE windows from launcher arguments only (seed, global step, prompt group)"


def needs(text: bytes, path: str) -> bool:
    """The SDE or a noise level, a window (or a noise level a window gates) and a source in the file (`text`
    lower-cased)."""
    return (
        any(token in text for token in _SDE_TOKENS)
        and any(token in text for token in _SINK_TOKENS)
        and any(token in text for token in _SOURCE_TOKENS)
    )


@dataclass(frozen=True)
class _Origin:
    node: ast.AST
    text: str
    clock: bool = False  # a timer: a source for seeds only (`start = time.perf_counter()` is timing code)


#: a generator seeded from launcher arguments in this function: its draws are reproducible
_SEEDED = _Origin(ast.Constant(value=None), "seeded")


def check(file: SourceFile) -> Iterator[Hit]:
    if not any(token in line.lower() for line in file.lines for token in _SDE_TEXT):
        return  # a window in a file that never names the SDE or a noise level: a profiler's, an attention's
    walker = _Walker(file)
    yield from walker.scope(file.tree, {}, {}, {})


def _rank_source(node: ast.AST, aliases) -> str | None:
    if (
        isinstance(node, ast.Subscript)
        and dotted(node.value, aliases) == "os.environ"
        and const(node.slice, None) in _RANK_ENV
    ):
        return f"`{short(node)}` changes with process placement"
    if isinstance(node, ast.Call):
        name = call_name(node, aliases)
        if name in ("os.environ.get", "os.getenv") and node.args and const(node.args[0], None) in _RANK_ENV:
            return f"`{short(node)}` changes with process placement"
        if _RANK_CALL.match(name.rsplit(".", 1)[-1]):
            return f"`{short(node)}` changes with process placement"
        if name == "os.getpid":
            return "`os.getpid()` changes with every process"
    if isinstance(node, ast.Attribute) and node.attr in _RANK_ATTRS and isinstance(node.ctx, ast.Load):
        return f"`{short(node)}` changes with process placement"
    if (
        isinstance(node, ast.Name)
        and isinstance(node.ctx, ast.Load)
        and (_RANK_NAME.match(node.id) or node.id in ("process_index", "local_process_index"))
    ):
        return f"`{node.id}` changes with process placement"
    if _is_request_id(node):
        return f"`{short(node)}` is one request's, not its prompt group's"
    return None


def _is_request_id(node: ast.AST) -> bool:
    """`request_id`, `req.request_id`, `getattr(req, "request_id", None)`: each rollout of a group has its own."""
    if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
        return words(last_name(node)) >= _REQUEST_ID_WORDS or words(last_name(node)) == {"req", "id"}
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) > 1
    ):
        return words(const(node.args[1], "")) >= _REQUEST_ID_WORDS
    return False


def _global_family(node: ast.AST, aliases) -> str | None:
    """'random' / 'numpy' / 'torch' for a draw from that global generator, else None."""
    if not isinstance(node, ast.Call):
        return None
    head, _, tail = call_name(node, aliases).rpartition(".")
    if head == "random" and tail in _PY_DRAWS:
        return "random"
    if head == "numpy.random" and tail not in _NUMPY_NOT_DRAWS:
        return "numpy"
    if head == "torch" and tail in _TORCH_DRAWS:
        generator = keyword(node, "generator")
        if generator is None or const(generator, object()) is None:
            return "torch"
    return None


_GLOBAL_TEXT = {
    "random": "the global `random` generator",
    "numpy": "the global NumPy generator",
    "torch": "torch's global generator",
}


def _random_source(node: ast.AST, aliases) -> _Origin | None:
    if not isinstance(node, ast.Call):
        return None
    name = call_name(node, aliases)
    head = name.rpartition(".")[0]
    if name == "hash" and isinstance(node.func, ast.Name):
        return _Origin(node, f"`{short(node)}` is salted per process (PYTHONHASHSEED)")
    if name == "id" and isinstance(node.func, ast.Name):
        return _Origin(node, f"`{short(node)}` is a memory address")
    if name in _CLOCK:
        return _Origin(node, f"the clock (`{short(node)}`) differs on every run", clock=True)
    if name in _ENTROPY or head == "secrets":
        return _Origin(node, f"OS entropy (`{short(node)}`) differs on every run")
    return None


def _unseeded_instance(node: ast.AST, aliases) -> ast.Call | None:
    """`random.Random()` / `np.random.default_rng()` built without a seed (also inside `a if c else b`)."""
    for sub in (node.body, node.orelse) if isinstance(node, ast.IfExp) else (node,):
        if (
            isinstance(sub, ast.Call)
            and call_name(sub, aliases) in _UNSEEDED_CONSTRUCTORS
            and not sub.args
            and keyword(sub, "seed") is None
            and keyword(sub, "x") is None
        ):
            return sub
    return None


def _seeder_by_last_name(name: str) -> str:
    """`accelerate.utils.set_seed` -> 'set_seed', `pl.seed_everything` -> 'seed_everything'; else ''."""
    last = name.rsplit(".", 1)[-1]
    return last if last in ("set_seed", "seed_everything") else ""


def _is_window_name(name: str | None) -> bool:
    return bool(words(name) & _WINDOW_WORDS)


def _noise_gates(file: SourceFile) -> set[str]:
    """Names compared with a loop index in an `if` whose branches set a noise level: they decide which
    denoising steps get noise (`if i == random_timestep: cur_noise_level = noise_level`). One set per file."""
    loop_names = {
        name
        for node in file.statements
        if isinstance(node, (ast.For, ast.AsyncFor))
        for name in bound_names(node.target)
    }
    gates: set[str] = set()
    if not loop_names:
        return gates
    for node in file.statements:
        if not isinstance(node, ast.If):
            continue
        sets_noise = any(
            isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            and any(
                words(last_name(t)) >= _NOISE_LEVEL_WORDS or "sde" in words(last_name(t))
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
            )
            for stmt in (*node.body, *node.orelse)
        )
        if not sets_noise:
            continue
        for compare in ast.walk(node.test):
            if not isinstance(compare, ast.Compare):
                continue
            sides = [compare.left, *compare.comparators]
            if not any(isinstance(s, ast.Name) and s.id in loop_names for s in sides):
                continue
            for side in sides:
                base = side.value if isinstance(side, ast.Subscript) else side
                if isinstance(base, ast.Name) and base.id not in loop_names:
                    gates.add(base.id)
    return gates


class _Walker:
    def __init__(self, file: SourceFile) -> None:
        self.file = file
        self.aliases = file.aliases
        self.reported: set[int] = set()
        self.gates = _noise_gates(file)

    def scope(
        self,
        scope: ast.AST,
        tainted: dict[str, _Origin],
        rngs: dict[str, _Origin],
        seeded: dict[str, _Origin],
    ) -> Iterator[Hit]:
        """Walk one scope; `tainted` names hold a bad value, `rngs` names a generator that is unseeded or seeded
        from one, `seeded` the global generators this scope seeded (bad origin, or `_SEEDED`). Nested scopes
        start from a copy of the state at their definition."""
        state = (dict(tainted), dict(rngs), dict(seeded))
        yield from self._block(scope.body, state, words(getattr(scope, "name", "")))

    def _block(self, body: list[ast.stmt], state: tuple[dict, dict, dict], function_words) -> Iterator[Hit]:
        """The statements of one block in order; an `if`'s branches each from the same state, and after it
        what either left (a window drawn in one branch from an unseeded generator is still drawn)."""
        tainted, rngs, seeded = state
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                text = self.file.text_of(stmt).lower()
                if any(token in text for token in _SINK_TEXT):  # no window in it, none in what it nests
                    yield from self.scope(stmt, tainted, rngs, seeded)
                continue
            yield from self._statement(stmt, state, function_words)
            if isinstance(stmt, ast.If):
                other = (dict(tainted), dict(rngs), dict(seeded))
                yield from self._block(stmt.body, state, function_words)
                yield from self._block(stmt.orelse, other, function_words)
                for mine, theirs in zip(state, other, strict=True):
                    for name, origin in theirs.items():
                        if mine.get(name) in (None, _SEEDED):
                            mine[name] = origin
                continue
            for name, value in ast.iter_fields(stmt):
                if isinstance(value, list) and name != "targets":
                    for item in value:
                        if isinstance(item, ast.stmt):
                            yield from self._block([item], state, function_words)
                        elif isinstance(item, (ast.ExceptHandler, ast.match_case)):
                            yield from self._block(item.body, state, function_words)

    def _statement(self, stmt: ast.stmt, state: tuple[dict, dict, dict], function_words) -> Iterator[Hit]:
        tainted, rngs, seeded = state
        for value, what, clock_counts in self._sinks(stmt, function_words, self.gates):
            origin = self._source(value, tainted, rngs, seeded)
            if origin is None or origin is _SEEDED or (origin.clock and not clock_counts):
                continue
            if id(origin.node) in self.reported:
                continue
            self.reported.add(id(origin.node))
            line = getattr(self.file.statement_of(value), "lineno", None)
            at = f" (line {line})" if line is not None and line != origin.node.lineno else ""
            yield Hit(
                self.file,
                origin.node,
                f"{origin.text}, and it decides the SDE window {what}{at}: rollouts of one prompt group then draw "
                f"other windows on other ranks, processes or requests; {_FIX}",
                also=(value,),
            )
        self._seed_globals(stmt, tainted, rngs, seeded)
        self._bind(stmt, tainted, rngs, seeded)

    def _source(self, expr: ast.AST, tainted, rngs, seeded) -> _Origin | None:
        for node in nodes_in_order(expr):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in tainted:
                return tainted[node.id]
            text = _rank_source(node, self.aliases)
            if text is not None:
                return _Origin(node, text)
            origin = _random_source(node, self.aliases)
            if origin is not None:
                return origin
            family = _global_family(node, self.aliases)
            if family is not None:
                if family in seeded:
                    if seeded[family] is _SEEDED:
                        continue
                    return seeded[family]
                return _Origin(
                    node,
                    f"{_GLOBAL_TEXT[family]} (`{short(node)}`) depends on how this process seeded it and on every "
                    "earlier draw",
                )
            if isinstance(node, ast.Call):
                generator = keyword(node, "generator")
                if isinstance(generator, ast.Name) and generator.id in rngs:
                    return rngs[generator.id]
                func = node.func
                if isinstance(func, ast.Attribute):
                    if isinstance(func.value, ast.Name) and func.value.id in rngs:
                        return rngs[func.value.id]
                    instance = _unseeded_instance(func.value, self.aliases)
                    if instance is not None:
                        return _Origin(instance, f"an unseeded `{short(instance)}` differs on every run")
        return None

    def _sinks(self, stmt: ast.stmt, function_words, gates: set[str]) -> Iterator[tuple[ast.AST, str, bool]]:
        """(value, what it is, whether the clock counts as a bad source) for each window this statement makes."""
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            yield from self._assigned_windows(stmt, function_words, gates)
        if isinstance(stmt, ast.Return) and stmt.value is not None and function_words & _WINDOW_WORDS:
            yield stmt.value, "this function returns", False
        for node in self.file.own_nodes(stmt):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg and _is_window_name(kw.arg):
                    yield kw.value, f"`{kw.arg}=`", False
            if _is_window_name(last_name(node.func)):
                shown = f"drawn by `{short(node.func, 40)}(...)`"
                for kw in node.keywords:
                    if words(kw.arg) & _SEED_ARGUMENT_WORDS:
                        yield kw.value, shown, True

    def _assigned_windows(self, stmt, function_words, gates: set[str]) -> Iterator[tuple[ast.AST, str, bool]]:
        for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
            for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                name = last_name(element)
                if (
                    _is_window_name(name)
                    or (isinstance(element, ast.Name) and element.id in gates)
                    or (
                        words(name) & _START_WORDS
                        and (function_words & _SDE_WORDS or any(words(i) & _SDE_WORDS for i in identifiers(stmt.value)))
                    )
                ):
                    yield stmt.value, f"`{short(element, 30)}`", False
                    return

    def _seed_globals(self, stmt: ast.stmt, tainted, rngs, seeded) -> None:
        """`random.seed(x)`, `torch.manual_seed(x)`, `set_seed(x)`: the global generators' draws come from x."""
        for node in self.file.own_nodes(stmt):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = call_name(node, self.aliases)
            families = _GLOBAL_SEEDERS.get(name) or _GLOBAL_SEEDERS.get(_seeder_by_last_name(name), ())
            if not families:
                continue
            origin = self._source(node.args[0], tainted, rngs, seeded) or _SEEDED
            specific = keyword(node, "device_specific")
            if origin is _SEEDED and specific is not None and const(specific, None) is not False:
                origin = _Origin(specific, "`device_specific=True` adds the process index to the seed")
            for family in families:
                seeded[family] = origin

    def _bind(self, stmt: ast.stmt, tainted, rngs, seeded) -> None:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call = stmt.value  # `generator.manual_seed(x)` on its own line
            func = call.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("manual_seed", "seed")
                and call.args
                and isinstance(func.value, ast.Name)
                and func.value.id not in self.aliases
                and func.value.id not in _GLOBAL_MODULES
            ):
                origin = self._source(call.args[0], tainted, rngs, seeded)
                rngs.pop(func.value.id, None)
                if origin is not None and origin is not _SEEDED and not origin.clock:
                    rngs[func.value.id] = origin
            return
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            return
        value = stmt.value
        instance = _unseeded_instance(value, self.aliases)
        rng_origin: _Origin | None = None
        if instance is not None:
            rng_origin = _Origin(
                instance, f"an unseeded `{short(instance)}` (line {instance.lineno}) differs on every run"
            )
        elif isinstance(value, ast.Call) and (
            last_name(value.func) in _RNG_CONSTRUCTORS or last_name(value.func) in ("manual_seed", "seed")
        ):
            rng_origin = self._source(value, tainted, rngs, seeded)  # a generator seeded from a bad value
            if rng_origin is _SEEDED:
                rng_origin = None
        origin = None if rng_origin is not None else self._source(value, tainted, rngs, seeded)
        if origin is _SEEDED:
            origin = None
        for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
            for name in bound_names(target):
                tainted.pop(name, None)
                rngs.pop(name, None)
                if rng_origin is not None:
                    rngs[name] = rng_origin
                elif origin is not None:
                    tainted[name] = origin
