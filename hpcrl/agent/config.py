"""Configuration of agent episodes (``hpcrl.agent``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

Export = Literal["concat", "individual"]
EXPORTS: tuple[str, ...] = get_args(Export)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class AgentConfig:
    # "pkg.module:function" of `async def f(data: dict, *, base_url: str, api_key: str) -> float`, run once per
    # sample against the rollout's OpenAI-compatible proxy; "" = no agent: one completion per sample, reward.fn
    fn: str = ""
    timeout_s: float = 300.0  # an episode running longer is cancelled and scores 0
    max_concurrent_episodes: int = 64  # episodes one rollout job runs at once (admission keeps this many busy)
    host: str = "127.0.0.1"  # where the proxy listens (loopback: only this job's agents reach it)
    port: int = 0  # the proxy's port (0 = a free one)
    # a file (mode 600) holding the key of the proxy's admin API (/admin/sessions: add keys, set rewards, end
    # episodes, for agents and graders outside the job); "" = no admin API. Needed to listen beyond loopback.
    admin_key_file: str = ""
    # how an episode's model calls become training samples: concat = one sequence of the conversation (what the
    # model did not write loss-masked); individual = each call its own sample (its prompt, its output)
    export: Export = "concat"
    # individual: call k of K gets the episode's reward times turn_discount ** (K - 1 - k) (the last one all of it)
    turn_discount: float = 1.0
    # the proxy's limits (docs/agents.md, "Limits and errors"): a larger request body gets 413 before it is parsed
    max_request_bytes: int = 4 * 1024 * 1024
    # longest prompt of a call, in tokens (400 context_length_exceeded beyond); 0 = the model's context minus
    # rollout.max_new_tokens
    max_prompt_tokens: int = 0
    session_max_in_flight: int = 16  # completions of one episode (all its keys; n counts n) in flight; 0 = no cap
    session_rate_limit: float = 50.0  # requests per second of one episode (burst: one second's worth); 0 = no cap

    def __post_init__(self) -> None:
        if self.fn and ":" not in self.fn:
            raise ValueError(f"fn: expected 'package.module:function', got {self.fn!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.max_concurrent_episodes < 1:
            raise ValueError(f"max_concurrent_episodes: must be >= 1, got {self.max_concurrent_episodes}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}")
        for name in ("max_prompt_tokens", "session_max_in_flight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0: the default), got {getattr(self, name)}")
        if not (math.isfinite(self.session_rate_limit) and self.session_rate_limit >= 0):
            raise ValueError(f"session_rate_limit: must be a number >= 0 (0: no cap), got {self.session_rate_limit}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.export not in EXPORTS:
            raise ValueError(f"export: must be one of {list(EXPORTS)}, got {self.export!r}")
        if not (math.isfinite(self.turn_discount) and 0.0 <= self.turn_discount <= 1.0):
            raise ValueError(f"turn_discount: must be in [0, 1], got {self.turn_discount}")
        if self.export == "individual" and not self.fn:
            raise ValueError("export: 'individual' exports agent episodes; set agent.fn (without an agent every "
                             "sample is one completion)")
        if self.turn_discount != 1.0 and self.export != "individual":
            raise ValueError(f"turn_discount: discounts the turns of export=individual only, got "
                             f"{self.turn_discount} with export={self.export!r} (a concat episode is one sample)")
        if self.admin_key_file and not self.fn:
            raise ValueError("admin_key_file: the admin API is the agent proxy's; set agent.fn")
        if self.host not in LOOPBACK and not self.admin_key_file:
            raise ValueError(f"host: {self.host!r} is not loopback ({', '.join(LOOPBACK)}): a proxy other nodes "
                             "reach needs agent.admin_key_file (its admin key guards the sessions' keys)")
