"""NaN capture and exact replay (consistency/training/nan_capture.py, consistency/training/rng_state.py)."""

from __future__ import annotations

import copy
import errno
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from rollout_consistency.training import nan_capture
from rollout_consistency.training.nan_capture import (
    CaptureDirectoryError,
    CaptureWriteError,
    NanCapture,
    NonFiniteGradientError,
    grads_are_finite,
    load_capture,
    nan_capture_callback,
    replay,
)
from rollout_consistency.training.rng_state import (
    capture_rng_state,
    isolated_rng,
    restore_rng_state,
    rng_state_from_dict,
    rng_state_to_dict,
)

NUM_CLASSES = 4
CLASS_PROBS = torch.tensor([0.3, 0.3, 0.3, 0.1])  # class 3 is rare: some batches have none of it
BATCH = 32
REPO = Path(__file__).resolve().parents[1]


class TwoHeadModel(nn.Module):
    """Shared trunk, a classification head and a regression head behind dropout.

    The class-balanced loss below makes the trunk and classification head gradients NaN when a class
    is absent from the batch; the regression head's gradients stay finite and depend on the dropout
    mask, so a replay that got the RNG wrong shows up in them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, NUM_CLASSES)
        self.dropout = nn.Dropout(0.3)
        self.reg_head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.trunk(x)
        return self.cls_head(hidden), self.reg_head(self.dropout(hidden)).squeeze(-1)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 8, generator=generator)
    labels = torch.multinomial(CLASS_PROBS, BATCH, replacement=True, generator=generator)
    return x, labels, x.sum(dim=1)


def class_balanced_loss(logits: torch.Tensor, labels: torch.Tensor, clamp_counts: bool) -> torch.Tensor:
    """Mean over classes of the mean cross-entropy within the class: 0/0 = NaN for an absent class."""
    per_sample = nn.functional.cross_entropy(logits, labels, reduction="none")
    total = logits.new_zeros(())
    for c in range(NUM_CLASSES):
        mask = (labels == c).float()
        count = mask.sum().clamp(min=1.0) if clamp_counts else mask.sum()
        total = total + (per_sample * mask).sum() / count
    return total / NUM_CLASSES


def make_step_fn(model: TwoHeadModel, clamp_counts: bool = False):
    def forward_backward(batch):
        x, labels, target = batch
        logits, regression = model(x)
        loss = class_balanced_loss(logits, labels, clamp_counts) + nn.functional.mse_loss(regression, target)
        loss.backward()
        return loss.detach()

    return forward_backward


def make_model_and_optimizer(seed: int = 0) -> tuple[TwoHeadModel, torch.optim.Optimizer]:
    with isolated_rng(seed):
        model = TwoHeadModel()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def steps_with_absent_class(max_steps: int = 200) -> list[int]:
    return [step for step in range(max_steps) if len(torch.unique(make_batch(step)[1])) < NUM_CLASSES]


BAD_STEPS = steps_with_absent_class()
EXPECTED_STEP = BAD_STEPS[0]


def train(model, optimizer, steps, capture=None, clamp_counts=False, before_check=None):
    """Seeded training loop; `before_check(step)` runs just before the capture check."""
    step_fn = make_step_fn(model, clamp_counts)
    with isolated_rng(7):  # dropout draws from the global generator; seed it explicitly
        for step in range(steps):
            batch = make_batch(step)
            if capture is not None:
                capture.begin_step(step)
            optimizer.zero_grad()
            step_fn(batch)
            if before_check is not None:
                before_check(step)
            if capture is not None:
                capture.check(batch)
            optimizer.step()


def reference_state_before(step: int) -> tuple[dict, dict]:
    """Weights and optimizer state right before `step`'s update, from a run without the hook."""
    model, optimizer = make_model_and_optimizer()
    train(model, optimizer, step)
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        return tensor
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def assert_bitwise_equal_states(actual, expected, where: str = "state") -> None:
    """Recursive bit-exact comparison of state dicts (tensors by bit pattern, NaN included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape and torch.equal(_bits(actual), _bits(expected)), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_bitwise_equal_states(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=False)):
            assert_bitwise_equal_states(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


def test_expected_step_is_not_the_first() -> None:
    # The scenario needs healthy steps before the bad one, so that "not later" means something.
    assert 2 <= EXPECTED_STEP <= 50 and len(BAD_STEPS) > 1


def test_capture_fires_at_the_first_non_finite_step(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    capture = NanCapture(model, optimizer, tmp_path / "captures")
    with pytest.raises(NonFiniteGradientError) as info:
        train(model, optimizer, 100, capture=capture)
    error = info.value
    assert error.step == EXPECTED_STEP
    assert error.path == tmp_path / "captures" / f"nonfinite-step{EXPECTED_STEP:08d}.pt"
    assert str(error.path) in str(error) and "replay" in str(error)
    assert sorted(p.name for p in (tmp_path / "captures").iterdir()) == [error.path.name]
    assert set(error.parameters) == {"trunk.0.weight", "trunk.0.bias", "cls_head.weight", "cls_head.bias"}

    # The capture holds the state before the update of that step, and the update was not applied.
    expected_model, expected_optimizer = reference_state_before(EXPECTED_STEP)
    record = load_capture(error.path)
    assert record.step == EXPECTED_STEP
    assert_bitwise_equal_states(record.model_state, expected_model)
    assert_bitwise_equal_states(record.optimizer_state, expected_optimizer)
    assert_bitwise_equal_states(model.state_dict(), expected_model)
    assert_bitwise_equal_states(optimizer.state_dict(), expected_optimizer)
    _x, labels, _target = record.batch
    assert torch.equal(labels, make_batch(EXPECTED_STEP)[1])
    assert not math.isfinite(float(record.grads["trunk.0.weight"].sum()))
    assert torch.isfinite(record.grads["reg_head.weight"]).all()


def test_replay_reproduces_the_non_finite_gradients_bit_for_bit(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    with pytest.raises(NonFiniteGradientError) as info:
        train(model, optimizer, 100, capture=NanCapture(model, optimizer, tmp_path))
    path = info.value.path
    record = load_capture(path)

    # A fresh process would build a differently initialised model; replay must not care.
    fresh_model, fresh_optimizer = make_model_and_optimizer(seed=123)
    torch.manual_seed(999)  # and its RNG would be anywhere
    result = replay(path, make_step_fn(fresh_model), model=fresh_model, optimizer=fresh_optimizer)
    assert result.step == EXPECTED_STEP
    assert result.grads_bitwise_equal, result.mismatched_parameters
    assert set(result.nonfinite_parameters) == set(record.nonfinite_parameters)
    assert not math.isfinite(float(result.output))
    assert_bitwise_equal_states(fresh_optimizer.state_dict(), record.optimizer_state)

    # The comparison is sensitive: the same step from another RNG state gives other dropout masks,
    # hence other (finite) regression-head gradients, and replay reports them.
    def wrong_rng_step_fn(batch):
        torch.manual_seed(2024)
        return make_step_fn(fresh_model)(batch)

    result = replay(path, wrong_rng_step_fn, model=fresh_model)
    assert not result.grads_bitwise_equal
    assert "reg_head.weight" in result.mismatched_parameters


def test_reusing_the_clip_norm_captures_the_same_step_and_replays(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    step_fn = make_step_fn(model)

    def forward_backward_clip(batch):  # clipping happens before the check, so it is part of the step
        step_fn(batch)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)

    capture = NanCapture(model, optimizer, tmp_path)
    with pytest.raises(NonFiniteGradientError) as info, isolated_rng(7):
        for step in range(100):
            batch = make_batch(step)
            capture.begin_step(step)
            optimizer.zero_grad()
            norm = forward_backward_clip(batch)
            capture.check(batch, grad_norm=norm)
            optimizer.step()
    assert info.value.step == EXPECTED_STEP
    fresh_model, _ = make_model_and_optimizer(seed=5)
    step_fn = make_step_fn(fresh_model)

    def replay_fn(batch):
        step_fn(batch)
        return torch.nn.utils.clip_grad_norm_(fresh_model.parameters(), max_norm=1.0)

    result = replay(info.value.path, replay_fn, model=fresh_model)
    assert result.grads_bitwise_equal, result.mismatched_parameters


def test_a_non_finite_norm_of_finite_gradients_is_confirmed_element_wise(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    capture = NanCapture(model, optimizer, tmp_path)
    capture.begin_step(0)
    make_step_fn(model, clamp_counts=True)(make_batch(0))
    assert capture.check(make_batch(0), grad_norm=torch.tensor(float("inf")))  # e.g. the norm overflowed
    assert list(tmp_path.iterdir()) == []


def test_clean_run_writes_nothing(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    directory = tmp_path / "captures"
    capture = NanCapture(model, optimizer, directory)
    train(model, optimizer, EXPECTED_STEP + 10, capture=capture, clamp_counts=True)
    assert capture.captured_path is None
    assert list(directory.iterdir()) == []


def test_unwritable_directory_fails_at_start_with_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model, optimizer = make_model_and_optimizer()
    with pytest.raises(CaptureDirectoryError, match=r"not writable.*NanCapture\(directory=") as info:
        NanCapture(model, optimizer, blocker / "captures")
    assert str(blocker / "captures") in str(info.value)


def _snapshot_before_check(model, optimizer, step_of_interest):
    saved = {}

    def before_check(step):
        if step == step_of_interest:
            saved["model"] = copy.deepcopy(model.state_dict())
            saved["optimizer"] = copy.deepcopy(optimizer.state_dict())

    return saved, before_check


def test_directory_gone_at_capture_time_leaves_training_state_intact(tmp_path: Path) -> None:
    directory = tmp_path / "captures"
    model, optimizer = make_model_and_optimizer()
    capture = NanCapture(model, optimizer, directory)
    directory.rmdir()
    directory.write_text("someone replaced the directory by a file")
    saved, before_check = _snapshot_before_check(model, optimizer, EXPECTED_STEP)
    with pytest.raises(CaptureWriteError, match="could not be written") as info:
        train(model, optimizer, 100, capture=capture, before_check=before_check)
    assert info.value.step == EXPECTED_STEP and info.value.path is None
    assert isinstance(info.value, NonFiniteGradientError)  # one except clause catches both
    assert isinstance(info.value.__cause__, OSError)
    assert_bitwise_equal_states(model.state_dict(), saved["model"])
    assert_bitwise_equal_states(optimizer.state_dict(), saved["optimizer"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["captures"]


def test_disk_full_mid_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def write_half_then_fail(payload, file):  # injected fault: ENOSPC after some bytes hit the disk
        file.write(b"\x80\x02partial pickle" * 100)
        file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nan_capture, "_serialize", write_half_then_fail)
    directory = tmp_path / "captures"
    model, optimizer = make_model_and_optimizer()
    capture = NanCapture(model, optimizer, directory)
    saved, before_check = _snapshot_before_check(model, optimizer, EXPECTED_STEP)
    with pytest.raises(CaptureWriteError, match=r"No space left on device.*Free disk space") as info:
        train(model, optimizer, 100, capture=capture, before_check=before_check)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert list(directory.iterdir()) == []
    assert_bitwise_equal_states(model.state_dict(), saved["model"])
    assert_bitwise_equal_states(optimizer.state_dict(), saved["optimizer"])


def test_real_write_failure_from_a_file_size_limit(tmp_path: Path) -> None:
    # No injection: the kernel refuses the write (EFBIG) once the file passes RLIMIT_FSIZE. Runs in a
    # subprocess because the limit applies to the whole process.
    script = textwrap.dedent(
        f"""
        import os, resource, signal, sys
        import torch
        from rollout_consistency.training.nan_capture import NanCapture, CaptureWriteError
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        capture = NanCapture(model, optimizer, {str(tmp_path)!r})
        before = {{k: v.clone() for k, v in model.state_dict().items()}}
        capture.begin_step(0)
        (model(torch.ones(1, 64)) * float("nan")).sum().backward()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            capture.check(torch.ones(1, 64))
        except CaptureWriteError as error:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            assert error.__cause__.errno == 27, error.__cause__  # EFBIG
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            assert os.listdir({str(tmp_path)!r}) == [], os.listdir({str(tmp_path)!r})
            print("OK")
            sys.exit(0)
        sys.exit("no CaptureWriteError")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-2000:]


@pytest.mark.parametrize("earlier", [1, 2])
def test_existing_captures_are_not_overwritten(tmp_path: Path, earlier: int) -> None:
    # Earlier runs that failed at the same step left `.pt`, then `.1.pt`: the next capture takes the next free name.
    names = [f"nonfinite-step{EXPECTED_STEP:08d}{suffix}.pt" for suffix in ("", ".1", ".2")]
    for index in range(earlier):
        (tmp_path / names[index]).write_bytes(f"earlier capture {index}".encode())
    model, optimizer = make_model_and_optimizer()
    with pytest.raises(NonFiniteGradientError) as info:
        train(model, optimizer, 100, capture=NanCapture(model, optimizer, tmp_path))
    assert info.value.path.name == names[earlier]
    for index in range(earlier):
        assert (tmp_path / names[index]).read_bytes() == f"earlier capture {index}".encode()


def test_stop_false_returns_false_and_captures_only_the_first(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    capture = NanCapture(model, optimizer, tmp_path, stop=False)
    step_fn = make_step_fn(model)
    results = []
    steps = BAD_STEPS[1] + 2
    for step in range(steps):
        batch = make_batch(step)
        capture.begin_step(step)
        optimizer.zero_grad()
        step_fn(batch)
        finite = capture.check(batch)
        results.append(finite)
        if finite:
            optimizer.step()
    assert results.index(False) == EXPECTED_STEP
    # later bad batches are reported (and skipped by the loop) but not captured
    assert [step for step, finite in enumerate(results) if not finite] == [s for s in BAD_STEPS if s < steps]
    assert [p.name for p in tmp_path.iterdir()] == [f"nonfinite-step{EXPECTED_STEP:08d}.pt"]
    assert capture.captured_path == tmp_path / f"nonfinite-step{EXPECTED_STEP:08d}.pt"


def test_check_without_begin_step_is_an_error(tmp_path: Path) -> None:
    model, optimizer = make_model_and_optimizer()
    capture = NanCapture(model, optimizer, tmp_path)
    with pytest.raises(RuntimeError, match="begin_step"):
        capture.check(None)
    capture.begin_step(0)
    make_step_fn(model)(make_batch(0))
    assert capture.check(make_batch(0))
    with pytest.raises(RuntimeError, match="begin_step"):  # one snapshot per step
        capture.check(make_batch(0))


@pytest.mark.parametrize(
    "tensors, expected",
    [
        ([torch.ones(3), torch.zeros(2, 2)], True),
        ([torch.ones(3), torch.tensor([1.0, float("nan")])], False),
        ([torch.tensor([float("inf")]), torch.ones(3)], False),
        ([torch.tensor([-float("inf"), 0.0])], False),
        # huge but finite: the 2-norm pre-check overflows, the element-wise confirmation clears it
        ([torch.full((4,), 3.0e38), torch.full((4,), -3.0e38)], True),
        ([torch.full((4,), 6.0e4, dtype=torch.float16)], True),
        ([torch.ones(2, dtype=torch.bfloat16), torch.tensor([float("nan")], dtype=torch.float16)], False),
        ([torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float64)], True),
        ([torch.empty(0), torch.ones(2)], True),
        ([], True),
        ([torch.sparse_coo_tensor([[0, 2]], [1.0, float("nan")], (4,), check_invariants=True)], False),
        ([torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)], True),
    ],
)
def test_grads_are_finite(tensors, expected) -> None:
    assert grads_are_finite(tensors) is expected
    assert nan_capture.grads_are_finite_stacked(tensors) is expected
    assert nan_capture.grads_are_finite_inf_norm(tensors) is expected


def test_nan_in_any_position_of_many_tensors_is_found() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(int(n), generator=generator) for n in torch.randint(1, 300, (40,), generator=generator)]
    assert grads_are_finite(tensors)
    for index in (0, 17, 39):
        for position in (0, tensors[index].numel() - 1):
            broken = [t.clone() for t in tensors]
            broken[index][position] = float("nan")
            assert not grads_are_finite(broken)


def test_rng_state_round_trip_through_a_safe_torch_file(tmp_path: Path) -> None:
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3)

    with isolated_rng(5):
        state = capture_rng_state()
        first = draw()
        torch.save(rng_state_to_dict(state), tmp_path / "rng.pt")
        draw()
        restore_rng_state(rng_state_from_dict(torch.load(tmp_path / "rng.pt", weights_only=True)))
        second = draw()
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_isolated_rng_leaves_the_callers_generators_alone() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    with isolated_rng(99):
        torch.rand(10)
        random.random()
        np.random.rand(4)
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert expected[:2] == got[:2] and torch.equal(expected[2], got[2])


def test_load_capture_rejects_other_files(tmp_path: Path) -> None:
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a NaN-capture file"):
        load_capture(tmp_path / "other.pt")


def test_lightning_callback(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (optional integration)")

    class LitModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TwoHeadModel()

        def training_step(self, batch, batch_idx):
            x, labels, target = batch
            logits, regression = self.net(x)
            return class_balanced_loss(logits, labels, False) + nn.functional.mse_loss(regression, target)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    batches = [make_batch(step) for step in range(EXPECTED_STEP + 5)]
    with isolated_rng(0):
        module = LitModel()
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            callbacks=[nan_capture_callback(tmp_path)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with pytest.raises(NonFiniteGradientError) as info:
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert info.value.step == EXPECTED_STEP
    fresh = LitModel()
    result = replay(info.value.path, lambda batch: fresh.training_step(batch, 0).backward(), model=fresh)
    assert result.grads_bitwise_equal, result.mismatched_parameters
