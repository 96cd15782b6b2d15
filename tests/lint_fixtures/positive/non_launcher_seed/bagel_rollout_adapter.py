"""non-launcher-seed, true positives: SDE windows seeded from the process placement, reported where the rank
is read (verl-omni's BAGEL adapter forms). Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import os
import random


def _pick_sde_window(window_size, window_range, seed, request_id=None):
    if window_range is None:
        return (0, int(window_size))
    low, high = int(window_range[0]), int(window_range[1])
    if seed is not None:
        rng = random.Random(int(seed))
    else:
        rng = random.Random()  # expect: non-launcher-seed
    begin = rng.randint(low, high - int(window_size))
    return (begin, begin + int(window_size))


class BagelPipelineWithLogProb:
    def forward(self, req):
        extra_args = req.sampling_params.extra_args
        noise_level = float(extra_args.get("noise_level", 0.0))
        sde_window_size = extra_args.get("sde_window_size", None)
        sde_window = None
        if sde_window_size and noise_level > 0.0:
            sde_window = _pick_sde_window(
                window_size=int(sde_window_size),
                window_range=extra_args.get("sde_window_range"),
                seed=int(os.environ["LOCAL_RANK"]),  # expect: non-launcher-seed
            )
        self.scheduler_kwargs = {k: extra_args[k] for k in ("noise_level", "sde_type") if k in extra_args}
        return self.run(req, sde_window=sde_window)


def window_from_local_rank(num_steps, window_size):
    local_rank = int(os.environ["LOCAL_RANK"])  # expect: non-launcher-seed
    device = f"cuda:{local_rank}"
    sde_window_start = local_rank % (num_steps - window_size + 1)
    return sde_window_start, device
