"""An episode's budgets, sampling and prompt settings, read from a ``Config`` once.

Read by the episode loop (``async_agent_rl.episode.EpisodeRunner``), which both the rollout actors and the
demonstration writer (``warm_start.demos``) run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from async_agent_rl.config import Config


@dataclass
class EpisodeSettings:
    max_turns: int
    max_tokens_per_turn: int
    max_response_length: int
    max_obs_length: int
    max_model_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_turn_tokens: int = 8
    reward_terms: list[tuple[str, float]] = field(default_factory=lambda: [("exact_match", 1.0)])
    max_prompt_length: int = 4096
    prompt_template: str = "search_r1"
    prompt_from: str = "template"
    apply_chat_template: bool = True

    @classmethod
    def from_config(cls, cfg: Config) -> "EpisodeSettings":
        r = cfg.rollout
        return cls(
            max_turns=r.max_turns,
            max_tokens_per_turn=r.max_tokens_per_turn,
            max_response_length=r.max_response_length,
            max_obs_length=r.max_obs_length,
            max_model_len=cfg.model.max_model_len,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            min_turn_tokens=min(8, r.max_tokens_per_turn),
            reward_terms=[(t.name, t.weight) for t in cfg.reward.terms],
            max_prompt_length=cfg.data.max_prompt_length,
            prompt_template=cfg.data.prompt_template,
            prompt_from=cfg.data.prompt_from,
            apply_chat_template=cfg.data.apply_chat_template,
        )
