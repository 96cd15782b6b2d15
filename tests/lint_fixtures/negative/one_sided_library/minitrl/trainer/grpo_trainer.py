"""An LLM trainer that talks to a vLLM server through the client. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from ..extras.vllm_client import VLLMClient
from .utils import pad


class GRPOTrainer:
    def __init__(self, model, args):
        self.model = model
        self.client = VLLMClient(args.vllm_server_host, args.vllm_server_port) if args.use_vllm else None
        self.pad = pad
