# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`non-launcher-seed`: an SDE window or a noise seed taken from the rank, the process, a request id's hash,
the clock or an unseeded / global RNG instead of the launcher's arguments.

Then the windows (and noise) change with the number of GPUs, the rank order, the process, or simply from
run to run, and rollouts of one prompt group get different windows (their reward variance then measures
timestep bias instead of the policy).

*Where a seed or window is made* (the sinks):
* an assignment to a name, attribute or string key with a `seed`/`window` word (`seed`, `noise_seed`,
  `sde_window`, `window_start`, `batch["seed"]`), or to `start`/`begin`/`offset` when the value or the
  enclosing function mentions a window or the SDE;
* a keyword argument with a `seed`/`window` word (`seed=`, `sde_window=`);
* the arguments of a seeding call: `manual_seed`, `seed`, `manual_seed_all`, `set_seed`, `seed_everything`,
  `seed_all`, `random.Random`, `np.random.default_rng`/`RandomState`/`SeedSequence`; accelerate's
  `set_seed(..., device_specific=True)` (it adds the process index);
* what a function with a `seed`/`window` word in its name returns.

*Where it must not come from* (the sources; also through names bound to them earlier in the scope):
`os.environ[...]`/`os.getenv(...)` of RANK, LOCAL_RANK, NODE_RANK, WORLD_SIZE, SLURM_PROCID and kin;
`*.get_rank()` and kin; `.process_index`, `.local_process_index`, `.local_rank`, `.global_rank`, `.rank`
and names `rank`, `local_rank`, `global_rank`, `node_rank`, `dp_rank`, `sp_rank`, `process_index`;
`os.getpid()`; builtin `hash()` (str hashes are salted per process) and `id()`; the clock; `uuid`; OS
entropy; draws from the global `random` / `numpy.random` generators; `torch.rand*`/`normal`/`multinomial`
without `generator=`; draws from a `random.Random()` / `np.random.default_rng()` built without a seed.

Left alone: rank used for anything else (`f"cuda:{local_rank}"`, `set_device`, `if rank == 0`, a sampler's
`rank=`), draws from a generator seeded with launcher arguments, `hashlib` digests, `torch.initial_seed()`.
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
    iter_statements,
    keyword,
    last_name,
    nodes_in_order,
    short,
    words,
)
from .model import Hit
from .source import SourceFile

__all__ = ["RULE_ID", "check"]

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
_SEEDING_CALLS = frozenset(
    {
        "manual_seed",
        "manual_seed_all",
        "seed",
        "set_seed",
        "seed_everything",
        "seed_all",
        "Random",
        "default_rng",
        "RandomState",
        "SeedSequence",
    }
)
_SEED_WORDS = frozenset({"seed", "seeds", "window", "windows"})
_START_WORDS = frozenset({"start", "begin", "offset"})
_WINDOW_WORDS = frozenset({"window", "windows", "sde"})

_FIX = "derive seeds and SDE windows from launcher arguments only (seed, global step, prompt group)"


@dataclass(frozen=True)
class _Origin:
    node: ast.AST
    text: str
    clock: bool = False  # a timer: a source for seeds only (`start = time.perf_counter()` is timing code)


def check(files) -> Iterator[Hit]:
    for file in files:
        yield from _Walker(file).scope(file.tree, {}, {})


def _rank_source(node: ast.AST, aliases) -> str | None:
    if (
        isinstance(node, ast.Subscript)
        and dotted(node.value, aliases) == "os.environ"
        and const(node.slice, None) in _RANK_ENV
    ):
        return f"`{short(node)}`, which changes with process placement"
    if isinstance(node, ast.Call):
        name = call_name(node, aliases)
        if name in ("os.environ.get", "os.getenv") and node.args and const(node.args[0], None) in _RANK_ENV:
            return f"`{short(node)}`, which changes with process placement"
        if _RANK_CALL.match(name.rsplit(".", 1)[-1]):
            return f"`{short(node)}`, which changes with process placement"
        if name == "os.getpid":
            return "`os.getpid()`, which changes with every process"
    if isinstance(node, ast.Attribute) and node.attr in _RANK_ATTRS and isinstance(node.ctx, ast.Load):
        return f"`{short(node)}`, which changes with process placement"
    if (
        isinstance(node, ast.Name)
        and isinstance(node.ctx, ast.Load)
        and (_RANK_NAME.match(node.id) or node.id in ("process_index", "local_process_index"))
    ):
        return f"`{node.id}`, which changes with process placement"
    return None


def _random_source(node: ast.AST, aliases) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    name = call_name(node, aliases)
    head, _, tail = name.rpartition(".")
    if name == "hash" and isinstance(node.func, ast.Name):
        return f"`{short(node)}`, whose str hashes are salted per process (PYTHONHASHSEED)"
    if name == "id" and isinstance(node.func, ast.Name):
        return f"`{short(node)}`, a memory address"
    if name in _CLOCK:
        return f"the clock (`{short(node)}`), which differs on every run"
    if name in _ENTROPY or head == "secrets":
        return f"OS entropy (`{short(node)}`)"
    if head == "random" and tail in _PY_DRAWS:
        return f"the global `random` generator (`{short(node)}`), which depends on every earlier draw"
    if head == "numpy.random" and tail not in _NUMPY_NOT_DRAWS:
        return f"the global NumPy generator (`{short(node)}`), which depends on every earlier draw"
    if head == "torch" and tail in _TORCH_DRAWS and keyword(node, "generator") is None:
        return f"torch's global generator (`{short(node)}` without generator=), which depends on every earlier draw"
    func = node.func
    if isinstance(func, ast.Attribute) and _unseeded_instance(func.value, aliases) is not None:
        return f"an unseeded `{short(func.value)}`, which differs on every run"
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


def _is_seed_name(name: str | None) -> bool:
    return bool(words(name) & _SEED_WORDS)


class _Walker:
    def __init__(self, file: SourceFile) -> None:
        self.file = file
        self.aliases = file.aliases
        self.reported: set[int] = set()

    def scope(self, scope: ast.AST, tainted: dict[str, _Origin], rngs: dict[str, _Origin]) -> Iterator[Hit]:
        """Walk one scope; `tainted` names hold a bad value, `rngs` names an RNG that is unseeded or seeded
        from one. Nested scopes start from a copy of the state at their definition."""
        tainted, rngs = dict(tainted), dict(rngs)
        function_words = words(getattr(scope, "name", ""))
        for stmt, _ in iter_statements(scope.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from self.scope(stmt, tainted, rngs)
                continue
            for value, what, clock_counts in self._sinks(stmt, function_words):
                origin = self._device_specific(value) or self._source(value, tainted, rngs)
                if origin is None or (origin.clock and not clock_counts) or id(origin.node) in self.reported:
                    continue
                self.reported.add(id(origin.node))
                yield Hit(self.file, value, f"{what} comes from {origin.text}; {_FIX}")
            self._bind(stmt, tainted, rngs)

    def _source(self, expr: ast.AST, tainted, rngs) -> _Origin | None:
        for node in nodes_in_order(expr):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in tainted:
                return tainted[node.id]
            text = _rank_source(node, self.aliases) or _random_source(node, self.aliases)
            if text is not None:
                return _Origin(node, text, clock=text.startswith("the clock"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver = node.func.value
                if isinstance(receiver, ast.Name) and receiver.id in rngs:
                    return rngs[receiver.id]
        return None

    def _sinks(self, stmt: ast.stmt, function_words: frozenset[str]) -> Iterator[tuple[ast.AST, str, bool]]:
        """(value, what it is, whether the clock counts as a bad source: seeds yes, windows no) for each
        seed or window this statement makes."""
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    name = last_name(element)
                    if _is_seed_name(name):
                        yield stmt.value, f"`{short(element, 30)}`", bool(words(name) & {"seed", "seeds"})
                        return
                    if words(name) & _START_WORDS and (
                        function_words & _WINDOW_WORDS or any(words(i) & _WINDOW_WORDS for i in identifiers(stmt.value))
                    ):
                        yield stmt.value, f"`{short(element, 30)}`", False
                        return
        if isinstance(stmt, ast.Return) and stmt.value is not None and function_words & _SEED_WORDS:
            yield stmt.value, "the seed or window this function returns", bool(function_words & {"seed", "seeds"})
        for node in self.file.own_nodes(stmt):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg and _is_seed_name(kw.arg):
                    yield kw.value, f"`{kw.arg}=`", bool(words(kw.arg) & {"seed", "seeds"})
            name = call_name(node, self.aliases)
            if name.rsplit(".", 1)[-1] in _SEEDING_CALLS:
                for arg in node.args:
                    yield arg, f"the seed of `{dotted(node.func) or last_name(node.func)}(...)`", True
                if self._device_specific(node) is not None:
                    yield node, "the seed of `set_seed(...)`", True

    def _device_specific(self, node: ast.AST) -> _Origin | None:
        """accelerate's `set_seed(seed, device_specific=True)` adds the process index to the seed."""
        if isinstance(node, ast.Call) and call_name(node, self.aliases).rsplit(".", 1)[-1] == "set_seed":
            specific = keyword(node, "device_specific")
            if specific is not None and const(specific, None) is not False:
                return _Origin(
                    specific, "the process index (`device_specific=True`), which changes with process placement"
                )
        return None

    def _bind(self, stmt: ast.stmt, tainted, rngs) -> None:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            return
        value = stmt.value
        instance = _unseeded_instance(value, self.aliases)
        if instance is not None:
            rng_origin: _Origin | None = _Origin(
                instance, f"an unseeded `{short(instance)}` (line {instance.lineno}), which differs on every run"
            )
        elif isinstance(value, ast.Call) and last_name(value.func) in _SEEDING_CALLS:
            rng_origin = self._source(value, tainted, rngs)  # an RNG seeded from a bad value
        else:
            rng_origin = None
        origin = None if rng_origin is not None else self._source(value, tainted, rngs)
        for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
            for name in bound_names(target):
                tainted.pop(name, None)
                rngs.pop(name, None)
                if rng_origin is not None:
                    rngs[name] = rng_origin
                elif origin is not None:
                    tainted[name] = origin
