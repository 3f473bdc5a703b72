"""A session's calls as training data: the conversation tree and its ``concat`` export.

Call B *continues* call A when B's prompt starts with A's prompt followed by
A's output tokens (the proxy builds chat continuations that way, see
:meth:`hpcrl.agent.proxy.AgentProxy.chat_prompt`). The calls of one session
form a tree under that relation; ``concat`` exports the branch that ends in
the session's last call as one sequence: the first call's prompt, then each
call's output tokens (trained, with their behaviour logprobs and versions)
and between them the tokens the model did not write (tool results,
environment or user turns, template glue), loss-masked. Calls off that
branch (retries, ``n > 1`` siblings) are not trained and are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.agent.proxy import Call
from hpcrl.rollout.episodes import Episode

__all__ = ["Exported", "concat", "continues"]


@dataclass
class Exported:
    prompt_ids: list[int]  # the first call's prompt on the branch
    episode: Episode  # everything after it
    turns: int  # calls on the branch
    off_branch: int  # calls of the session not on it


def continues(later: Call, earlier: Call) -> bool:
    head = len(earlier.prompt_ids) + len(earlier.output_ids)
    return (len(later.prompt_ids) >= head and later.prompt_ids[:len(earlier.prompt_ids)] == earlier.prompt_ids
            and later.prompt_ids[len(earlier.prompt_ids):head] == earlier.output_ids)


def concat(calls: list[Call], text: str = "") -> Exported | None:
    """The branch ending in the last call as one Episode (None: no call). ``text``: the episode's text
    for the spool's meta (the agent's final answer, say)."""
    if not calls:
        return None
    branch = [calls[-1]]
    for call in reversed(calls[:-1]):  # the nearest earlier call each one continues
        if continues(branch[0], call):
            branch.insert(0, call)
    ids, logprobs, versions, mask = [], [], [], []
    for k, call in enumerate(branch):
        if k:  # the context between the previous call's output and this call's
            prev = branch[k - 1]
            gap = call.prompt_ids[len(prev.prompt_ids) + len(prev.output_ids):]
            version = call.versions[0] if call.versions else (prev.versions[-1] if prev.versions else 0)
            ids += gap
            logprobs += [0.0] * len(gap)
            versions += [version] * len(gap)
            mask += [0] * len(gap)
        ids += call.output_ids
        logprobs += call.logprobs
        versions += call.versions
        mask += [1] * len(call.output_ids)
    reason = "stop" if branch[-1].finish_reason in ("stop", "tool_calls") else "length"
    return Exported(list(branch[0].prompt_ids),
                    Episode(response_ids=ids, logprobs=logprobs, versions=versions, loss_mask=mask, text=text,
                            finish_reason=reason),
                    turns=len(branch), off_branch=len(calls) - len(branch))
