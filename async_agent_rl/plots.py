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
