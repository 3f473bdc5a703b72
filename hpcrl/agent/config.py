"""Configuration of agent episodes (``hpcrl.agent``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AgentConfig:
    # "pkg.module:function" of `async def f(data: dict, *, base_url: str, api_key: str) -> float`, run once per
    # sample against the rollout's OpenAI-compatible proxy; "" = no agent: one completion per sample, reward.fn
    fn: str = ""
    timeout_s: float = 300.0  # an episode running longer is cancelled and scores 0
    max_concurrent_episodes: int = 64  # episodes one rollout job runs at once (admission keeps this many busy)
    host: str = "127.0.0.1"  # where the proxy listens (loopback: only this job's agents reach it)
    port: int = 0  # the proxy's port (0 = a free one)

    def __post_init__(self) -> None:
        if self.fn and ":" not in self.fn:
            raise ValueError(f"fn: expected 'package.module:function', got {self.fn!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.max_concurrent_episodes < 1:
            raise ValueError(f"max_concurrent_episodes: must be >= 1, got {self.max_concurrent_episodes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.host not in ("127.0.0.1", "localhost", "::1"):  # the sessions' keys are the only guard
            raise ValueError(f"host: the proxy binds loopback only (127.0.0.1, localhost, ::1), got {self.host!r}; "
                             "agent programs run inside the rollout job")
