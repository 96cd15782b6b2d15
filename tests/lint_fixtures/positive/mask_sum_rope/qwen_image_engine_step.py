"""mask-sum-rope, true positive: a file that runs inside the vLLM-omni engine (it imports it).
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from vllm_omni.diffusion.request import OmniDiffusionRequest


def text_inputs(request: OmniDiffusionRequest):
    mask = request.prompt_embeds_mask
    txt_seq_lens = (mask.sum(dim=1)).tolist()  # expect: mask-sum-rope
    return request.prompt_embeds, txt_seq_lens
