"""PNG plots of a run folder: reward and exact match, throughput, staleness (matplotlib, no display)."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """The records of a run folder's JSON-lines file (``metrics.jsonl``, ``eval.jsonl``); [] when absent."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    if not rows:
        return []
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    step = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(step, [r["batch_reward"] for r in rows], label="batch reward")
    ax.plot(step, [r["rollout_exact_match"] for r in rows], label="rollout exact match")
    if evals:
        ax.plot([e["step"] for e in evals], [e["all"]["exact_match"] for e in evals], "o-", label="held-out EM (greedy)")
    ax.set_xlabel("learner step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.set_title("reward and exact match")
    written.append(_save(fig, out / "reward_exact_match.png"))

    learning = [r.get("learning") or {} for r in rows]
    if any(learning):
        fig, axes = plt.subplots(1, 4, figsize=(20, 4))
        kinds = sorted({k for x in learning for k in x.get("by_kind", {})} |
                       {k for e in evals for k in e if isinstance(e[k], dict) and "exact_match" in e[k]} - {"all"})
        for kind in kinds:
            pts = [(s, x["by_kind"][kind]["exact_match"]) for s, x in zip(step, learning) if kind in x.get("by_kind", {})]
            if pts:
                line = axes[0].plot(*zip(*pts), alpha=0.6, label=f"rollout, {kind}")[0]
                ev = [(e["step"], e[kind]["exact_match"]) for e in evals if kind in e]
                if ev:
                    axes[0].plot(*zip(*ev), "o-", color=line.get_color(), label=f"held-out (greedy), {kind}")
            pts = [(s, x["by_kind"][kind]["searches"]) for s, x in zip(step, learning)
                   if "searches" in x.get("by_kind", {}).get(kind, {})]
            if pts:
                line = axes[1].plot(*zip(*pts), alpha=0.6, label=f"rollout, {kind}")[0]
                ev = [(e["step"], e[kind]["searches_per_question"]) for e in evals if kind in e]
                if ev:
                    axes[1].plot(*zip(*ev), "o-", color=line.get_color(), label=f"held-out (greedy), {kind}")
        axes[0].set_ylim(-0.02, 1.02)
        axes[0].set_title("exact match by question kind")
        axes[0].legend(fontsize=7)
        axes[1].set_ylim(bottom=0)
        axes[1].set_title("searches per episode by question kind")
        axes[1].legend(fontsize=7)
        axes[2].plot(step, [x.get("entropy") for x in learning])
        axes[2].set_title("policy entropy (nats per generated token)")
        axes[3].plot(step, [x.get("zero_variance_share") for x in learning])
        axes[3].set_ylim(-0.02, 1.02)
        axes[3].set_title("share of groups with equal rewards (no signal)")
        for ax in axes:
            ax.set_xlabel("learner step")
        written.append(_save(fig, out / "learning.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    t = [r["elapsed_s"] for r in rows]
    ax.plot(t, [r["gen_tokens_per_s"] for r in rows], label="generated tokens/s")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(t, [r["episodes_per_s"] for r in rows], color="tab:orange", label="episodes/s")
    ax2.set_ylabel("episodes/s")
    ax.set_title("rollout throughput (cumulative average)")
    fig.legend(loc="lower right")
    written.append(_save(fig, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(step, [r["learner"].get("staleness_mean", 0) for r in rows], label="batch staleness mean")
    ax.plot(step, [r["learner"].get("staleness_max", 0) for r in rows], label="batch staleness max")
    ax.plot(step, [sum(r["buffer_evicted"].values()) for r in rows], label="evicted (cumulative)")
    ax.set_xlabel("learner step")
    ax.legend()
    ax.set_title("staleness (versions behind the learner)")
    written.append(_save(fig, out / "staleness.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
