"""The vLLM reward's helper.

Lint fixture: parsed, never imported or run.
"""


def normalise(text):
    return text.strip().lower()
