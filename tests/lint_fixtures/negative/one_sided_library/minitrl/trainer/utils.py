"""Helpers every trainer imports, the vLLM client too. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""


def pad(tensors, padding_value=0):
    width = max(t.shape[-1] for t in tensors)
    return [t.new_full((*t.shape[:-1], width), padding_value) for t in tensors]
