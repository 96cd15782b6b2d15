"""Batch-invariant mode (rollout_consistency.adapters.batch_invariance): every sample's rollout and recomputed
log-probs are bit-identical whatever its batch-mates, batch size, micro-batch size, position or step-wise
arrival pattern — every family (Wan as Wan 2.2's two experts), CFG on and off. Tiny sizes (32 px, 4 steps, 5
frames) keep this file fast."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rollout_args import rollout_args
from sd3_flux_cases import FAMILIES

from rollout_consistency.adapters import BatchRequests, SamplingSettings, qwen_image, recompute_step_log_prob, wan
from rollout_consistency.adapters.batch_invariance import (
    ROUTE_FIXED_SHAPE,
    ROUTE_PER_ROW,
    BatchInvariant,
    batch_invariant,
    is_batch_invariant,
)
from rollout_consistency.adapters.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG
from rollout_consistency.adapters.stepwise import EngineSettings, StepwiseRequest, run_stepwise
from rollout_consistency.adapters.tiny import TinyPromptEncoder, load_qwen_image, load_wan, tiny_wan_prompt_encoder
from rollout_consistency.schedulers import SDEWindow

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [1, 2, 3, 4]
STEPS = 4
WINDOW = SDEWindow(start=1, size=2, num_steps=STEPS)


class Case:
    """One family as these tests drive it: its adapter module, model, conditioning and CFG settings."""

    def __init__(self, name: str):
        self.name = name
        self.video: dict = {}
        if name == "wan":  # two experts: at 4 steps the window's steps 1, 2 fall on both sides of the boundary
            self.adapter, self.model = wan, load_wan(boundary_ratio=0.875)
            self.cond = tiny_wan_prompt_encoder().conditioning(PROMPTS, [""] * 4)
            self.cfg_on, self.cfg_key = {"guidance_scale": 4.0, "guidance_scale_2": 3.0}, "guidance_scale"
            self.video = {"num_frames": 5}
        elif name == "qwen-image":
            self.adapter, self.model = qwen_image, load_qwen_image()
            self.cond = TinyPromptEncoder().conditioning(PROMPTS, [" "] * 4, pad_to=12)
            self.cfg_on, self.cfg_key = {"guidance_scale": 3.0}, "guidance_scale"
        else:
            family = FAMILIES[name]
            self.adapter, self.model = family.adapter, family.load()
            self.cond = family.conditioning(PROMPTS, [""] * 4)
            self.cfg_on, self.cfg_key = dict(family.cfg), family.cfg_key

    def settings(self, cfg: bool) -> dict:
        return {**self.cfg_on, self.cfg_key: self.cfg_on[self.cfg_key] if cfg else 1.0}

    def rollout(self, model, rows, cfg: bool):
        cond = {k: v[rows] for k, v in self.cond.items()}
        return self.adapter.rollout(
            model,
            cond,
            height=32,
            width=32,
            num_inference_steps=STEPS,
            **self.video,
            **rollout_args(
                {"seeds": [SEEDS[r] for r in rows], "window": WINDOW, "noise_level": 0.7, **self.settings(cfg)}
            ),
        )

    def recompute(self, model, trajectory):
        with torch.no_grad():
            return self.adapter.recompute_log_probs(model, trajectory)


@pytest.fixture(scope="module", params=["qwen-image", "sd3", "flux", "wan"])
def case(request) -> Case:
    return Case(request.param)


# 1: one row per forward. 3: forwards of three rows (batches of 4 are cut 3 + 1 and padded), where this
# machine's kernels pass the proxy's probes; otherwise the proxy falls back to one row per forward.
ROWS_PER_FORWARD = pytest.mark.parametrize("rows", [1, 3], ids=["per-row", "fixed-3"])


@ROWS_PER_FORWARD
@pytest.mark.parametrize("cfg", [False, True], ids=["cfg-off", "cfg-on"])
def test_every_micro_batch_and_order_gives_the_same_bits(case, cfg, rows):
    model = batch_invariant(case.model, case.adapter.FAMILY, rows_per_forward=rows)
    full = case.rollout(model, [0, 1, 2, 3], cfg)
    for micro in (1, 2, 3, 4):
        parts = [list(range(s, min(s + micro, 4))) for s in range(0, 4, micro)]
        recomputed = torch.cat([case.recompute(model, full.select(rows)) for rows in parts])
        assert torch.equal(recomputed, full.log_probs), f"micro-batch {micro}"
    # Shuffled order and another batch size: the rollout itself gives each sample the same bits.
    shuffled = case.rollout(model, [3, 0, 2], cfg)
    for name in ("latents", "log_probs", "final_latents"):
        assert torch.equal(getattr(shuffled, name), getattr(full, name)[[3, 0, 2]]), name
    assert torch.equal(case.recompute(model, shuffled.select([1, 2])), full.log_probs[[0, 2]])


@ROWS_PER_FORWARD
def test_staggered_stepwise_arrivals_give_the_request_level_bits(case, rows):
    model = batch_invariant(case.model, case.adapter.FAMILY, rows_per_forward=rows)
    reference = case.rollout(model, [0, 1, 2, 3], True)
    requests = [
        StepwiseRequest(
            f"r{i}",
            seed=SEEDS[i],
            conditioning={k: v[i : i + 1] for k, v in case.cond.items()},
            window=WINDOW,
            arrival=a,
        )
        for i, a in enumerate((0, 1, 1, 3))
    ]
    stepwise = run_stepwise(
        case.adapter.FAMILY,
        model,
        requests,
        scheduler_setup=reference.scheduler,
        sampling=reference.sampling,
        options=reference.family_options,
        engine=EngineSettings(max_num_seqs=3),
    )
    for name in ("latents", "log_probs", "final_latents"):
        assert torch.equal(getattr(stepwise, name), getattr(reference, name)), name
    assert torch.equal(case.recompute(model, stepwise.select([2])), reference.log_probs[[2]])


def test_default_mode_differs_where_this_machines_kernels_are_batch_variant(case):
    """Negative control: without the mode, single-row micro-batches re-score a rollout of 4 with other kernels
    on machines whose GEMM/attention kernels depend on the batch; the mode then closes a real gap."""
    full = case.rollout(case.model, [0, 1, 2, 3], True)
    single = torch.cat([case.recompute(case.model, full.select([i])) for i in range(4)])
    gap = float((single - full.log_probs).abs().max())
    if gap == 0:
        pytest.skip(f"{case.name}: this machine's kernels are batch-invariant here (micro-batch 1 vs 4: max |dlogp| 0)")
    assert gap < 1e-4  # rounding-level, not a bug
    model = batch_invariant(case.model, case.adapter.FAMILY)
    invariant = case.rollout(model, [0, 1, 2, 3], True)
    assert torch.equal(torch.cat([case.recompute(model, invariant.select([i])) for i in range(4)]), invariant.log_probs)


def test_the_proxy_is_the_transformer_with_the_same_parameters_and_gradients():
    model = load_qwen_image()
    proxy = batch_invariant(model, "qwen-image")
    assert is_batch_invariant(proxy) and not is_batch_invariant(model)
    assert proxy.config is model.config and list(proxy.parameters()) == list(model.parameters())
    assert batch_invariant(proxy, qwen_image.FAMILY).module is model  # no proxy of a proxy
    cond = TinyPromptEncoder().conditioning(PROMPTS[:2], pad_to=12)
    rollout = qwen_image.rollout(
        proxy,
        cond,
        height=32,
        width=32,
        num_inference_steps=STEPS,
        requests=BatchRequests(seeds=(1, 2), windows=WINDOW),
        sampling=SamplingSettings(noise_level=0.7),
    )
    log_prob = recompute_step_log_prob(proxy, rollout, 1)
    assert torch.equal(log_prob.detach(), rollout.log_probs[:, 1])
    log_prob.sum().backward()
    assert model.proj_out.weight.grad is not None and model.proj_out.weight.grad.abs().sum() > 0


def test_bad_uses_are_one_line_errors():
    model = load_qwen_image()
    proxy = BatchInvariant(model, frozenset({"hidden_states", "timestep"}))
    with pytest.raises(TypeError, match="by keyword"):
        proxy(torch.zeros(1, 4, 16))
    with pytest.raises(ValueError, match="different batch sizes"):
        proxy(hidden_states=torch.zeros(2, 4, 16), timestep=torch.zeros(3))
    with pytest.raises(ValueError, match="none of the per-row inputs"):
        proxy(encoder_hidden_states=torch.zeros(2, 4, 16))
    # Step-wise: text padded to the running batch's widest would depend on the batch-mates.
    cond = TinyPromptEncoder().conditioning(PROMPTS[:2])
    requests = []
    for i in range(2):
        own = {k: v[i : i + 1] for k, v in cond.items()}
        length = int(own["prompt_embeds_mask"].sum())
        own = {k: v[:, :length] for k, v in own.items()}
        requests.append(StepwiseRequest(f"r{i}", seed=i, conditioning=own, window=WINDOW))
    setup = qwen_image.FAMILY.scheduler_setup(QWEN_IMAGE_SCHEDULER_CONFIG, STEPS, model, {"height": 32, "width": 32})
    with pytest.raises(ValueError, match=r"Pass engine=EngineSettings\(text_width="):
        run_stepwise(
            qwen_image.FAMILY,
            batch_invariant(model, qwen_image.FAMILY),
            requests,
            scheduler_setup=setup,
            sampling=SamplingSettings(noise_level=0.7),
            options={"height": 32, "width": 32},
        )


# ---------------------------------------------------------------------------------------------------------------
# The fixed-shape route: taken only where this machine's kernels give a row the same bits at every position.

SIZE = {"height": 32, "width": 32}
# The environment that makes MKL, oneDNN and ATen use their AVX2 code paths (docs/performance.md).
AVX2_KERNELS = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


class VelocityCase:
    """Tiny Qwen-Image velocities of the four prompts, one step's inputs (no rollout: fast)."""

    def __init__(self):
        self.model = load_qwen_image()
        self.cond = TinyPromptEncoder().conditioning(PROMPTS, pad_to=12)
        generator = torch.Generator().manual_seed(0)
        shape = qwen_image.FAMILY.latent_shape(self.model, SIZE)
        self.latents = torch.randn((4, *shape), generator=generator)
        self.timesteps = torch.full((4,), 750.0)

    def velocity(self, model, rows):
        cond = {key: value[rows] for key, value in self.cond.items()}
        with torch.no_grad():
            return qwen_image.velocity(model, self.latents[rows], self.timesteps[rows], cond, 1.0, options=SIZE)

    def kernels_allow_fixed_shape(self, size: int) -> bool:
        """Brute force on the bare transformer: every row at every position of a forward of `size` rows,
        behind each other row as batch-mates, gives that row the same bits."""
        for row in range(4):
            seen = None
            for mate in (m for m in range(4) if m != row):
                for position in range(size):
                    order = [mate] * (size - 1)
                    order.insert(position, row)
                    out = self.velocity(self.model, order)[position]
                    if seen is not None and not torch.equal(out, seen):
                        return False
                    seen = out
        return True


def check_routes_and_bits(size: int = 3) -> str:
    """The proxy takes the fixed-shape route exactly where brute force finds the kernels position-invariant,
    and a row's velocity is bit-identical in every micro-batch and order either way. Returns the route."""
    case = VelocityCase()
    proxy = batch_invariant(case.model, qwen_image.FAMILY, rows_per_forward=size)
    full = case.velocity(proxy, [0, 1, 2, 3])
    expected = ROUTE_FIXED_SHAPE if case.kernels_allow_fixed_shape(size) else ROUTE_PER_ROW
    assert set(proxy.routes.values()) == {expected}
    for rows in ([0], [3, 1], [2, 0, 3], [1, 2, 3, 0, 2]):
        assert torch.equal(case.velocity(proxy, rows), full[rows]), rows
    return expected


def test_fixed_shape_route_is_taken_exactly_where_this_machines_kernels_allow_it():
    check_routes_and_bits()


def test_fixed_shape_route_under_avx2_kernels_in_a_subprocess():
    """The same on the AVX2 code paths (on Intel Xeons MKL's AVX2 SGEMM rounds rows by position: the proxy then
    falls back to one row per forward). What the AVX2 paths do on another CPU is that CPU's to say."""
    tests = Path(__file__).parent
    code = "import test_batch_invariance as t; print(t.check_routes_and_bits())"
    env = {**os.environ, **AVX2_KERNELS, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tests, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split()[-1] in (ROUTE_FIXED_SHAPE, ROUTE_PER_ROW)


def nudge_rows(monkeypatch, model, nudge):
    """Plant a batch-dependent last rounding in `model`'s forward: output row p times (1 + nudge(p, inputs))."""
    forward = model.forward

    def planted(**kwargs):
        sample = forward(**kwargs)[0]
        factors = torch.tensor([1 + nudge(p, kwargs) for p in range(sample.shape[0])], dtype=sample.dtype)
        return (sample * factors.view(-1, *([1] * (sample.dim() - 1))),)

    monkeypatch.setattr(model, "forward", planted)


@pytest.mark.parametrize(
    "nudge",
    [
        lambda p, kwargs: p * 2.0**-20,  # by position, as MKL's AVX2 SGEMM on Intel Xeons
        # only in the middle: the last position, where the batch-mate probe puts the row, agrees with the first
        lambda p, kwargs: 2.0**-20 if p == 1 else 0.0,
        lambda p, kwargs: float(kwargs["hidden_states"].abs().sum()) * 2.0**-24,  # by batch-mates
    ],
    ids=["position", "middle-position", "batch-mates"],
)
def test_kernels_that_depend_on_the_batch_send_the_proxy_to_one_row_per_forward(monkeypatch, nudge):
    case = VelocityCase()
    nudge_rows(monkeypatch, case.model, nudge)
    proxy = batch_invariant(case.model, qwen_image.FAMILY, rows_per_forward=3)
    full = case.velocity(proxy, [0, 1, 2, 3])
    assert set(proxy.routes.values()) == {ROUTE_PER_ROW}
    assert torch.equal(case.velocity(proxy, [3, 1]), full[[3, 1]])
    # First seen at micro-batch 1: the probe's batch-mates are the row's own inputs times -1/2.
    alone = batch_invariant(case.model, qwen_image.FAMILY, rows_per_forward=3)
    assert torch.equal(case.velocity(alone, [2]), full[[2]])
    assert set(alone.routes.values()) == {ROUTE_PER_ROW}
    # The probes are what keeps it exact: forced onto the fixed-shape route, the same kernels break it.
    monkeypatch.setattr(BatchInvariant, "_fixed_shape_is_invariant", lambda self, kwargs, rows: True)
    forced = batch_invariant(case.model, qwen_image.FAMILY, rows_per_forward=3)
    # (rows 1 and 3 sit at positions 1 and 0 of their forwards in the batch of 4, at 0 and 1 here)
    assert not torch.equal(case.velocity(forced, [1, 3]), case.velocity(forced, [0, 1, 2, 3])[[1, 3]])


def test_rows_per_forward_must_be_a_positive_integer():
    model = load_qwen_image()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="rows_per_forward must be an integer >= 1"):
            batch_invariant(model, "qwen-image", rows_per_forward=bad)
    assert batch_invariant(batch_invariant(model, "qwen-image", rows_per_forward=4), "qwen-image").rows_per_forward == 1


@pytest.mark.parametrize("rows", [2, 3], ids=["fixed-2", "fixed-3"])
def test_rows_regrouped_by_their_per_row_lists_come_back_to_their_own_samples(rows):
    """Rows whose per-row lists differ run in separate forwards and are put back in batch order. Grouping
    [a, b, b, a] runs rows 0, 3 then 1, 2: an order that is not its own inverse, so only the inverse
    permutation returns each output to its own sample."""
    case = VelocityCase()
    proxy = batch_invariant(case.model, qwen_image.FAMILY, rows_per_forward=rows)
    square, strip = [(1, 2, 2)], [(1, 1, 4)]  # two RoPE grids of the same 4 image tokens
    shapes = [square, strip, strip, square]

    def forward(batch):
        with torch.no_grad():
            return proxy(
                hidden_states=case.latents[batch],
                encoder_hidden_states=case.cond["prompt_embeds"][batch],
                encoder_hidden_states_mask=case.cond["prompt_embeds_mask"][batch],
                timestep=case.timesteps[batch] / 1000,
                img_shapes=[shapes[b] for b in batch],
                return_dict=False,
            )[0]

    full = forward([0, 1, 2, 3])
    assert len(proxy.routes) == 2  # two groups, each with its own route
    for row in range(4):
        assert torch.equal(full[row], forward([row])[0]), row
    # The grid is part of the computation: the same row under the other grid is another output.
    shapes[0] = strip
    assert not torch.equal(forward([0])[0], full[0])
