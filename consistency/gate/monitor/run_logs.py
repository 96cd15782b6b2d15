# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A training run's logged scalar series, read from the tracker's own files: no code change in the trainer.

::

    reader = open_run("tensorboard_log/proj/exp")   # or wandb/offline-run-*, or mlruns[/<exp>[/<run>]]
    log = reader.poll()                              # every point written so far; call again for the new ones
    log.series["rollout_corr/logprob_abs_diff_max"]  # ((step, value), ...) in the order they were written

Three formats, each read without the tracker's server or network:

* **TensorBoard** event files (``events.out.tfevents.*``), through tensorboard's own ``EventFileLoader`` (it
  reads the scalars of ``SummaryWriter.add_scalar`` and of ``tf.summary.scalar`` alike). A folder holding event
  files in several sub-folders is several runs: refused, naming them.
* **wandb offline runs** (``wandb/offline-run-*/run-<id>.wandb``): wandb's transaction log — a 7-byte header
  (``:W&B``, magic, version), then LevelDB's log format (32 KiB blocks of chunks: crc32c, length, type), each
  record a protobuf ``Record`` of ``wandb.proto``. Its ``history`` records carry the rows (``_step`` and one JSON
  value per key); an ``exit`` record marks the run ended. wandb drops a row logged at a step below the run's
  current one before it reaches the file, so steps here only grow.
* **MLflow file stores** (``mlruns/<experiment>/<run>/metrics/<name>``): one text line per point,
  ``<timestamp ms> <value> <step>`` (a name's ``/`` is a sub-folder); the run's ``meta.yaml`` ``status`` says
  whether it ended (3 FINISHED, 4 FAILED, 5 KILLED). Read as text, so no MLflow setting is needed.

Reading is incremental: `RunReader.poll` reads what was appended since the last call and leaves a record still
being written for the next one (``--follow``). Only scalars are kept: images, tables and text are skipped.
Points are kept exactly as written — repeated, out-of-order, NaN — for `watch_series` to judge; nothing here
drops or sorts them. Errors (`RunLogError`) are one line that names the fix.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_consistency.safeguards.paths import special_kind

__all__ = ["FORMATS", "RunLog", "RunLogError", "RunReader", "open_run", "read_run"]

#: The formats `open_run` reads.
FORMATS = ("tensorboard", "wandb", "mlflow")

_TB_GLOB = "events.out.tfevents."
_WANDB_MAGIC = b":W&B"
_WANDB_HEADER = 7
_LEVELDB_BLOCK = 32768
_LEVELDB_CHUNK_HEADER = 7  # crc32c (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_MLFLOW_ENDED = {3: "FINISHED", 4: "FAILED", 5: "KILLED"}


class RunLogError(ValueError):
    """A run that cannot be read: no such path, several runs where one was meant, a file of another format."""


@dataclass(frozen=True)
class RunLog:
    """What a run's files hold so far.

    Attributes:
        path: the file or folder read.
        kind: one of `FORMATS`.
        series: logged name -> ``((step, value), ...)`` in the order written (float; NaN and inf as written).
        ended: the run's own end mark — ``"FINISHED"``/``"FAILED"``/``"KILLED"`` (MLflow), ``"exit <code>"``
            (wandb) — or None: still running, or a format without one (TensorBoard).
    """

    path: str
    kind: str
    series: Mapping[str, tuple[tuple[int, float], ...]]
    ended: str | None = None


@dataclass
class RunReader:
    """Reads one run incrementally (`poll`); made by `open_run`. Holds the read positions, nothing else."""

    path: str
    kind: str
    _points: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    _state: dict[str, Any] = field(default_factory=dict)
    _ended: str | None = None

    def poll(self) -> RunLog:
        """Read what was written since the last call; the whole `RunLog` so far."""
        _POLLS[self.kind](self)
        return RunLog(
            path=self.path,
            kind=self.kind,
            series={name: tuple(points) for name, points in self._points.items()},
            ended=self._ended,
        )

    def _add(self, name: str, step: int, value: float) -> None:
        self._points.setdefault(name, []).append((int(step), float(value)))


def read_run(path: str | os.PathLike[str], kind: str | None = None) -> RunLog:
    """Everything a run's files hold now (`open_run` then one `RunReader.poll`)."""
    return open_run(path, kind).poll()


def open_run(path: str | os.PathLike[str], kind: str | None = None) -> RunReader:
    """A `RunReader` for the run at `path`; the format is recognised from the files unless `kind` names it.

    `path`: a TensorBoard log folder or event file; a wandb offline run folder, its ``.wandb`` file, or a
    ``wandb`` folder holding one run; an MLflow run folder, an experiment folder or a store (``mlruns``, also
    as ``file:mlruns``) holding one run. Raises `RunLogError` when nothing there is a run, or several are.
    """
    text = os.fspath(path)
    if text.startswith("file:"):
        text = text[len("file:") :]
    _refuse_special(text)
    if not os.path.exists(text):
        raise RunLogError(f"no such file or folder: {text}; name a TensorBoard log folder, a wandb run or an mlruns.")
    if kind is not None and kind not in FORMATS:
        raise RunLogError(f"unknown run format {kind!r}; name one of {', '.join(FORMATS)}.")
    found = {name: _FINDERS[name](text) for name in ([kind] if kind else FORMATS)}
    hits = {name: where for name, where in found.items() if where}
    if not hits:
        wanted = kind or "TensorBoard event files, a wandb offline run (run-*.wandb) or an MLflow run (meta.yaml)"
        raise RunLogError(f"{text} holds no {wanted}; name the folder the trainer logged to.")
    if len(hits) > 1 or any(len(where) > 1 for where in hits.values()):
        runs = sorted(where for places in hits.values() for where in places)
        shown = ", ".join(runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")
        raise RunLogError(f"{text} holds {len(runs)} runs ({shown}); name one of them.")
    (name, (where,)) = next(iter(hits.items()))
    return RunReader(path=where, kind=name)


def _refuse_special(path: str) -> None:
    """A FIFO, device or socket would block or never end a read: refused by name, unread."""

    kind = special_kind(path)
    if kind is not None:
        raise RunLogError(f"{path} is {kind}, not a run's file; name the folder the trainer logged to.")


# ----------------------------------------------------------------------------------------------------
# Finding the run: each finder returns the run folders (or files) it recognises under the path.
def _find_tensorboard(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path] if os.path.basename(path).startswith(_TB_GLOB) else []
    folders = set()
    for root, _, files in os.walk(path):
        if any(name.startswith(_TB_GLOB) for name in files):
            folders.add(root)
    return sorted(folders)


def _find_wandb(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path] if path.endswith(".wandb") else []
    runs = []
    for root, folders, files in os.walk(path):
        folders[:] = [f for f in folders if f != "latest-run"]  # a link to one of the runs beside it
        runs += [os.path.join(root, name) for name in files if name.startswith("run-") and name.endswith(".wandb")]
    return sorted(runs)


def _find_mlflow(path: str) -> list[str]:
    if os.path.isfile(path):
        return []
    runs = []
    for root, folders, files in os.walk(path):
        folders[:] = [f for f in folders if f != ".trash"]  # deleted runs
        if "meta.yaml" in files and os.path.isdir(os.path.join(root, "metrics")):
            runs.append(root)
            folders[:] = []
    return sorted(runs)


_FINDERS = {"tensorboard": _find_tensorboard, "wandb": _find_wandb, "mlflow": _find_mlflow}


# ----------------------------------------------------------------------------------------------------
# TensorBoard
def _poll_tensorboard(reader: RunReader) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    loaders: dict[str, Any] = reader._state.setdefault("loaders", {})
    plugins: dict[str, str] = reader._state.setdefault("plugins", {})
    if os.path.isfile(reader.path):
        files = [reader.path]
    else:  # a writer reopened (a resumed run) starts a new file beside the old ones; names sort by time
        names = sorted(n for n in os.listdir(reader.path) if n.startswith(_TB_GLOB))
        files = [os.path.join(reader.path, n) for n in names]
    for path in files:
        loader = loaders.get(path)
        if loader is None:
            _refuse_special(path)
            loader = loaders[path] = EventFileLoader(path)
        try:
            events = list(loader.Load())
        except Exception as error:  # a damaged file: tensorboard's own parse errors
            raise RunLogError(f"cannot read the TensorBoard event file {path}: {error}") from error
        for event in events:
            for value in event.summary.value:
                # After tensorboard's compatibility pass every scalar is a tensor of the "scalars" plugin; the
                # plugin is named on a tag's first value only.
                if value.metadata.plugin_data.plugin_name:
                    plugins[value.tag] = value.metadata.plugin_data.plugin_name
                if plugins.get(value.tag) != "scalars" or not value.HasField("tensor"):
                    continue
                array = tensor_util.make_ndarray(value.tensor)
                if array.size == 1:
                    reader._add(value.tag, event.step, float(array.reshape(())))


# ----------------------------------------------------------------------------------------------------
# wandb
def _poll_wandb(reader: RunReader) -> None:
    from wandb.proto import wandb_internal_pb2

    path = reader.path
    if os.path.isdir(path):  # an offline-run folder: its one transaction log
        logs = _find_wandb(path)
        if len(logs) != 1:
            raise RunLogError(f"{path} holds {len(logs)} wandb transaction logs (run-*.wandb); name one.")
        path = logs[0]
    state = reader._state
    position: int = state.get("position", 0)  # the first byte not yet read: a chunk's start
    _refuse_special(path)
    with open(path, "rb") as handle:
        handle.seek(position)
        data = handle.read()
    if position == 0:
        if len(data) < _WANDB_HEADER:
            return  # still being created
        if data[:4] != _WANDB_MAGIC:
            raise RunLogError(f"{path} is not a wandb transaction log (it does not start with ':W&B').")
        data, position = data[_WANDB_HEADER:], _WANDB_HEADER
    pending: bytes = state.get("pending", b"")  # the chunks so far of a record split across blocks
    offset = 0  # into data, which starts at file position `position`
    while True:
        at = position + offset
        left_in_block = _LEVELDB_BLOCK - at % _LEVELDB_BLOCK
        if left_in_block < _LEVELDB_CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            if len(data) - offset < left_in_block:
                break
            offset += left_in_block
            continue
        if len(data) - offset < _LEVELDB_CHUNK_HEADER:
            break
        _, length, chunk = struct.unpack("<IHB", data[offset : offset + _LEVELDB_CHUNK_HEADER])
        if len(data) - offset < _LEVELDB_CHUNK_HEADER + length:
            break  # still being written: read on the next poll
        payload = data[offset + _LEVELDB_CHUNK_HEADER : offset + _LEVELDB_CHUNK_HEADER + length]
        offset += _LEVELDB_CHUNK_HEADER + length
        if chunk == 0 and length == 0:  # zero fill
            continue
        if chunk not in (_FULL, _FIRST, _MIDDLE, _LAST):
            raise RunLogError(f"{path} is damaged at byte {at} (chunk type {chunk}); is it a wandb transaction log?")
        pending = payload if chunk in (_FULL, _FIRST) else pending + payload
        if chunk in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except Exception as error:  # protobuf's DecodeError
                raise RunLogError(f"{path} holds a record that is not wandb's at byte {at}: {error}") from error
            pending = b""
            _wandb_record(reader, record)
    state["position"] = position + offset
    state["pending"] = pending


def _wandb_record(reader: RunReader, record: Any) -> None:
    kind = record.WhichOneof("record_type")
    if kind == "exit":
        reader._ended = f"exit {record.exit.exit_code}"
        return
    if kind != "history":
        return
    row: dict[str, Any] = {}
    for item in record.history.item:
        key = item.key or "/".join(item.nested_key)
        try:
            row[key] = json.loads(item.value_json)
        except ValueError:
            continue
    step = row.get("_step", record.history.step.num if record.history.HasField("step") else None)
    if not isinstance(step, int):
        return
    for key, value in row.items():
        number = _wandb_number(value)
        if number is not None and not key.startswith("_"):
            reader._add(key, step, number)


def _wandb_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "infinity", "-infinity", "inf", "-inf"):
        return float(value.lower())  # wandb spells non-finite values as strings
    return None


# ----------------------------------------------------------------------------------------------------
# MLflow
_LINE = re.compile(rb"^(\S+) (\S+) (-?\d+)$")


def _poll_mlflow(reader: RunReader) -> None:
    offsets: dict[str, int] = reader._state.setdefault("offsets", {})
    metrics = os.path.join(reader.path, "metrics")
    for root, _, files in os.walk(metrics):
        for name in sorted(files):
            path = os.path.join(root, name)
            series = os.path.relpath(path, metrics).replace(os.sep, "/")
            _refuse_special(path)
            with open(path, "rb") as handle:
                handle.seek(offsets.get(path, 0))
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            offsets[path] = offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                match = _LINE.match(line.strip())
                if match is None:
                    raise RunLogError(
                        f"{path}: {line[:60]!r} is not an MLflow metric line ('<timestamp> <value> <step>')."
                    )
                reader._add(series, int(match.group(3)), _float(match.group(2), path))
    reader._ended = _mlflow_status(os.path.join(reader.path, "meta.yaml"))


def _float(text: bytes, path: str) -> float:
    try:
        return float(text)
    except ValueError as error:
        raise RunLogError(f"{path}: {text[:30]!r} is not a number.") from error


def _mlflow_status(meta: str) -> str | None:
    try:
        with open(meta, encoding="utf-8") as handle:
            found = re.search(r"^status: *'?(\w+)'?\s*$", handle.read(), re.MULTILINE)
    except OSError:
        return None
    if found is None:
        return None
    word = found.group(1)
    if word.isdigit():
        return _MLFLOW_ENDED.get(int(word))
    return word if word in _MLFLOW_ENDED.values() else None


_POLLS = {"tensorboard": _poll_tensorboard, "wandb": _poll_wandb, "mlflow": _poll_mlflow}
