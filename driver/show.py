"""Human-readable view of trajectories: what the learner trains on, turn by turn.

Model turns are printed as generated (loss_mask 1); observations are boxed with ``|`` and labelled ``loss 0``, so
a reader sees at once which tokens carry loss. ``tokens=True`` adds one line per token: id, piece, mask, version,
behavior log-prob.
"""

from __future__ import annotations

from typing import Any

from async_agent_rl.records import Trajectory


def format_trajectory(t: Trajectory, tokenizer: Any, tokens: bool = False) -> str:
    m = t.meta
    lines = [
        f"== trajectory {m.trajectory_id}  group {m.group_id}  question {m.question_id} ({m.data_source})",
        f"   reward {t.reward:.3f} {t.reward_components}  finish {m.finish_reason}  turns {m.num_turns}  "
        f"searches {m.num_searches} (errors {m.num_search_errors})  gold {m.gold_answers}",
        f"   prompt {len(t.prompt_ids)} tokens (loss 0), response {len(t.response_ids)} tokens "
        f"({t.num_generated_tokens} with loss), versions {t.min_version}..{t.max_version}",
        "-- prompt (loss 0)",
        _indent(tokenizer.decode(t.prompt_ids, skip_special_tokens=False), "   "),
    ]
    for i, span in enumerate(t.turns):
        ids = t.response_ids[span.start : span.end]
        mask = t.loss_mask[span.start : span.end]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if span.kind == "model":
            vs = t.versions[span.start : span.end]
            lines.append(
                f"-- turn {i}: MODEL  tokens [{span.start},{span.end})  loss {min(mask)}..{max(mask)}  "
                f"versions {min(vs)}..{max(vs)}"
            )
            lines.append(_indent(text, "   "))
        else:
            lines.append(f"-- turn {i}: OBSERVATION  tokens [{span.start},{span.end})  loss {max(mask)} (masked)")
            lines.append(_indent(text, "   | "))
        if tokens:
            for j in range(span.start, span.end):
                piece = tokenizer.decode([t.response_ids[j]], skip_special_tokens=False)
                lines.append(
                    f"      {j:5d} {t.response_ids[j]:7d} {piece!r:24} mask={t.loss_mask[j]} "
                    f"v={t.versions[j]} lp={t.behavior_logprobs[j]:.3f}"
                )
    return "\n".join(lines)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.split("\n"))
