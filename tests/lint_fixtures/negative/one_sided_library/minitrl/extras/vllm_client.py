"""The LLM generation client of a vLLM server (the rollout side of the library's LLM trainers).
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from ..trainer.utils import pad


class VLLMClient:
    def __init__(self, host="0.0.0.0", server_port=8000):
        self.base_url = f"http://{host}:{server_port}"
        self.pad = pad

    def generate(self, prompts, n=1, temperature=1.0):
        return {"prompts": prompts, "n": n, "temperature": temperature}
