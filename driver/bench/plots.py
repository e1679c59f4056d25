"""The studies' plots: one line per arm over training (exact match, reward, length, searches), staleness against
throughput, and ``bench learning``'s curves and bars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from driver.bench.arms import ArmRun
from driver.bench.results import KINDS, mean_of


def plot_study(runs: Sequence[ArmRun], path: Path, title: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.result]
    if not done:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [("held-out exact match (greedy)", None), ("batch reward", "reward"),
              ("response tokens per episode", "response_length"), ("searches per episode", "searches")]
    for ax, (name, key) in zip(axes.flat, panels):
        for r in done:
            if key is None:
                c = r.result["eval_curve"]
                ax.plot([x["step"] for x in c], [x["exact_match"] for x in c], "o-", label=r.arm.label)
            else:
                pts = [(x["step"], x[key]) for x in r.result["steps_curve"] if x.get(key) is not None]
                ax.plot([p[0] for p in pts], _smooth([p[1] for p in pts]), label=r.arm.label)
        ax.set_title(name)
        ax.set_xlabel("learner step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_staleness(runs: Sequence[ArmRun], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.result]
    if not done:
        return None
    done = [r for r in done if r.arm.name.removeprefix("eta").isdigit()]
    etas = [int(r.arm.name.removeprefix("eta")) for r in done]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(etas, [r.result["samples_per_s"] for r in done], "o-", label="trained samples/s")
    ax.set_xlabel("max_staleness (eta)")
    ax.set_ylabel("samples/s")
    ax2 = ax.twinx()
    ax2.plot(etas, [r.result["em_end"] for r in done], "s--", color="tab:green", label="held-out EM (end)")
    ax2.plot(etas, [r.result["reward_last"] for r in done], "^--", color="tab:orange", label="reward (last 25%)")
    ax2.set_ylim(0, 1)
    fig.legend(loc="lower right", fontsize=8)
    ax.set_title("throughput and reward against the staleness bound")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _smooth(xs: Sequence[float], k: int = 5) -> list[float]:
    return [mean_of(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def plot_learning(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Held-out EM over RL steps, one line per seed and one panel per kind of question; the warm start (step 0)
    as a square, the SFT-only arm (same time) as a star at RL's last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if not rows:
        return None
    fig, axes = plt.subplots(1, len(KINDS), figsize=(14, 4), sharey=True)
    for ax, (kind, title) in zip(axes, KINDS.items()):
        for i, r in enumerate(rows):
            if kind not in r["kinds"]:
                continue
            color = f"C{i % 10}"
            pts = [(c["step"], c[kind]) for c in r["curve"] if kind in c]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{r['seed'] if isinstance(r['seed'], str) else 'seed ' + str(r['seed'])} RL")
            ax.plot(pts[0][0], r["kinds"][kind]["em_start"], "s", color=color, markersize=9)
            ax.plot(pts[-1][0], r["kinds"][kind]["em_sft"], "*", color=color, markersize=14)
        ax.set_title(f"held-out EM (greedy): {title}")
        ax.set_xlabel("RL learner step")
        ax.set_ylim(-0.02, 1.02)
    handles, _ = axes[0].get_legend_handles_labels()
    handles += [Line2D([], [], marker="s", ls="", color="gray", label="warm start"),
                Line2D([], [], marker="*", ls="", color="gray", markersize=12, label="SFT-only, same time")]
    axes[0].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_learning_bars(summary: dict[str, Any], path: Path) -> Path | None:
    """Mean ± s.e. over seeds of held-out EM by arm, per kind of question."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if k in summary["kinds"]]
    if not kinds:
        return None
    arms = [("warm start", "em_start"), ("RL", "em_rl"), ("SFT-only (same time)", "em_sft")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(arms)
    for j, (label, key) in enumerate(arms):
        ms = [summary["kinds"][k][key] for k in kinds]
        ax.bar([i + (j - 1) * width for i in range(len(kinds))], [m["mean"] for m in ms], width,
               yerr=[0 if m["se"] != m["se"] else m["se"] for m in ms], capsize=4, label=label)
    ax.set_xticks(range(len(kinds)), [KINDS[k] for k in kinds])
    ax.set_ylabel("held-out exact match")
    ax.set_title(f"mean ± s.e. over {summary['rl_s']['n']} seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_seeds(arms: Sequence[Any], rows: dict[str, list[dict[str, Any]]], path: Path, title: str) -> Path | None:
    """``--seeds`` studies, from their per-seed rows: one panel per seed, held-out exact match against training
    seconds (evaluations taken out) per arm, the seed's accuracy target dashed; a last panel with the realized
    staleness of the trained-on trajectories per arm, over all seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r["seed"] for rs in rows.values() for r in rs})
    if not seeds:
        return None
    fig, axes = plt.subplots(1, len(seeds) + 1, figsize=(4.2 * (len(seeds) + 1), 3.8), squeeze=False)
    named = [a for a in arms if a.name in rows]
    for i, arm in enumerate(named):
        for r in rows[arm.name]:
            ax = axes[0][seeds.index(r["seed"])]
            c = r["eval_curve"]
            ax.plot([x["train_s"] for x in c], [x["exact_match"] for x in c], "o-", ms=3, color=f"C{i}",
                    label=arm.label)
    for ax, seed in zip(axes[0], seeds):
        target = next((r["target_em"] for rs in rows.values() for r in rs if r["seed"] == seed), None)
        if target is not None and target == target:
            ax.axhline(target, ls="--", color="gray", lw=0.8)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("training seconds (evaluations excluded)")
        ax.set_ylabel("held-out exact match (greedy)")
    axes[0][0].legend(fontsize=7)
    ax = axes[0][-1]
    width = 0.8 / max(1, len(named))
    for i, arm in enumerate(named):
        hist: dict[int, int] = {}
        for r in rows[arm.name]:
            for k, v in r["staleness_histogram"].items():
                hist[int(k)] = hist.get(int(k), 0) + v
        total = sum(hist.values()) or 1
        ks = sorted(hist)
        offset = (i - (len(named) - 1) / 2) * width
        ax.bar([k + offset for k in ks], [hist[k] / total for k in ks], width, color=f"C{i}", label=arm.label)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("staleness of trained-on trajectories")
    ax.set_xlabel("learner version - behaviour version")
    ax.set_ylabel("share")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
