"""Part of a single-process trainer: the sampling pipeline.

Lint fixture: parsed, never imported or run.
"""


def pipeline_with_logprob(pipeline, prompts, epoch):
    return pipeline(prompts, seed=epoch)
