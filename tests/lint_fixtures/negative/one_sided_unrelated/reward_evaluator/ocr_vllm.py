"""An OCR reward served by vLLM (a rollout word in its name, no precision flags).

Lint fixture: parsed, never imported or run.
"""

import utils


def score(images, prompts, llm):
    return [utils.normalise(llm.generate(image, prompt)) for image, prompt in zip(images, prompts)]
