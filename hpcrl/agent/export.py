"""A session's calls as training data: the ``concat`` and ``individual`` exports (``agent.export``).

Call B *continues* call A when B's prompt starts with A's prompt followed by
A's output tokens (the proxy builds chat continuations that way, see
:meth:`hpcrl.agent.proxy.AgentProxy.chat_prompt`). The calls of one session
form a tree under that relation; ``concat`` exports the branch that ends in
the session's last call as one sequence: the first call's prompt, then each
call's output tokens (trained, with their behaviour logprobs and versions)
and between them the tokens the model did not write (tool results,
environment or user turns, template glue), loss-masked. Calls off that
branch (retries, ``n > 1`` siblings) are not trained and are counted.

``individual`` makes every call with output tokens a sample of its own: its
prompt ids, then its output ids with their behaviour logprobs and versions,
all trained; no call is off a branch. The calls are the turns in the order
they finished (``n > 1`` siblings one after the other, in index order), and
turn ``k`` of ``K`` carries ``turn_discount ** (K - 1 - k)`` of the
episode's reward: the last call all of it, earlier ones less.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.agent.proxy import Call
from hpcrl.rollout.episodes import Episode

__all__ = ["Exported", "concat", "continues", "individual"]


@dataclass
class Exported:
    prompt_ids: list[int]  # the first call's prompt on the branch (individual: the first call's)
    episode: Episode  # everything after it (individual: no tokens of its own, one part per call)
    turns: int  # calls on the branch (individual: calls exported)
    off_branch: int  # calls of the session not exported


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
    return Exported(list(branch[0].prompt_ids),
                    Episode(response_ids=ids, logprobs=logprobs, versions=versions, loss_mask=mask, text=text,
                            finish_reason=_finish(branch[-1])),
                    turns=len(branch), off_branch=len(calls) - len(branch))


def individual(calls: list[Call], turn_discount: float = 1.0, text: str = "") -> Exported | None:
    """Every call with output tokens as a sample of its own, its reward share discounted by its distance (in
    calls) from the last one (None: no call). A session whose calls all came back empty is one empty sample,
    as ``concat`` makes it."""
    if not calls:
        return None
    turns = [c for c in calls if c.output_ids]
    if not turns:
        return concat(calls, text)
    parts = [Episode(response_ids=list(c.output_ids), logprobs=list(c.logprobs), versions=list(c.versions),
                     loss_mask=[1] * len(c.output_ids), text="", finish_reason=_finish(c),
                     prompt_ids=list(c.prompt_ids), reward_scale=turn_discount ** (len(turns) - 1 - k))
             for k, c in enumerate(turns)]
    episode = Episode(response_ids=[], logprobs=[], versions=[], loss_mask=[], text=text,
                      finish_reason=parts[-1].finish_reason, parts=parts)
    return Exported(list(turns[0].prompt_ids), episode, turns=len(turns), off_branch=len(calls) - len(turns))


def _finish(call: Call) -> str:
    return "stop" if call.finish_reason in ("stop", "tool_calls") else "length"
