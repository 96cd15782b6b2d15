# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Fail fast on a Ray address nobody answers at: Ray's own connect retries for minutes.

[`check_reachable`] opens (and closes) a TCP connection to the address's host and port within a timeout
before `ray.init` is called. ``"auto"`` and ``"local"`` are left to Ray, which answers at once when no
cluster runs on this machine. [`DistributedError`], raised here and by `distributed`, is the sharding's
usage error (exit code 2 on the command line).
"""

from __future__ import annotations

import socket
import time

from rollout_consistency.gate.config import ray_host_port

__all__ = ["DistributedError", "check_reachable"]


class DistributedError(RuntimeError):
    """Ray could not be used as asked (no Ray for --ray-address, a worker whose setup failed, ...)."""


def check_reachable(address: str, timeout_s: float) -> None:
    """Raise DistributedError (naming the fix) when `address` does not accept a connection within `timeout_s`
    (ConfigError when it is not an address: `rollout_consistency.gate.config.ray_host_port`)."""
    target = ray_host_port(address)
    if target is None:
        return
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection(target, timeout=remaining):
                return
        except OSError as error:  # refused, unreachable, unknown host, timed out
            last = error
            if isinstance(error, (socket.gaierror, TimeoutError)):
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise DistributedError(
        f"the Ray cluster at {address!r} cannot be reached within {timeout_s:g} s ({last}); start it or fix "
        f"--ray-address (raise --ray-timeout-s for a slow network)."
    )
