"""A DDPO trainer whose sampler is a plugin module named on the command line (`--sampler
ddpo.plugins.ddim_sampler`): the module's name is all run time, so no text tells which module runs, and no
module of this repository can be called a dead copy (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import argparse
import importlib

from ddpo.trainer import ppo_step

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sampler", required=True)
    args = parser.parse_args()
    sampler = importlib.import_module(args.sampler)
    for epoch in range(100):
        samples = sampler.sample_with_logprob(args)
        ppo_step(args, samples)
