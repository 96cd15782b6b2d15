"""The library's tests import the whole package. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import minitrl
from minitrl.extras.vllm_client import VLLMClient


def test_client_url():
    assert VLLMClient("localhost", 8001).base_url == "http://localhost:8001"
    assert minitrl.VLLMClient is VLLMClient
