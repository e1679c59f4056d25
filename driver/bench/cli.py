"""``async-agent-rl bench ...``: the argument parser and the commands of the staleness, ablation and sync studies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from async_agent_rl.config import Config, load_config
from driver.bench.arms import DEFAULT_STUDIES, STUDIES, Arm, staleness_arms, sync_arms
from driver.bench.learning import cmd_continue_sft, cmd_learning
from driver.bench.reports import sync_summary, write_report
from driver.bench.runner import command_line, finish, run_arms


def cmd_bench(args: argparse.Namespace) -> int:
    kind = args.kind
    out = Path(args.out or f"runs/bench/{kind}")
    if kind == "staleness":
        try:
            etas = [int(x) for x in args.etas.split(",") if x.strip()]
        except ValueError:
            print(f"error: --etas must be comma-separated integers, not {args.etas!r}", file=sys.stderr)
            return 2
        if not etas or min(etas) < 0:
            print(f"error: --etas needs at least one value >= 0, got {args.etas!r}", file=sys.stderr)
            return 2
        arms = staleness_arms(etas, ppo=args.seeds is not None and args.ppo_arm)
    elif kind == "ablations":
        names = [x.strip() for x in args.studies.split(",") if x.strip()]
        unknown = [n for n in names if n not in STUDIES]
        if unknown or not names:
            print(f"error: unknown studies {unknown}; choose from {', '.join(STUDIES)}", file=sys.stderr)
            return 2
        # every study's first value is the quickstart's: one run of the config as is is everyone's baseline
        arms = [Arm("baseline", "baseline", "baseline (config as is)", ())] + [
            a for n in names for a in STUDIES[n][1:]]
    else:
        arms = sync_arms(args.eta)
    base = load_config(args.config, args.overrides)  # a bad config fails here, before any run
    command = command_line(args)
    if args.seeds is not None:
        return _cmd_bench_seeds(args, kind, arms, base, out, command)
    runs = run_arms(args.config, list(args.overrides), arms, out, args.steps, args.eval_every, args.force,
                    warm_starts=Path(args.warm_starts) if args.warm_starts else None, report_only=args.report_only)
    extra = ""
    if kind == "sync":
        extra, numbers = sync_summary(runs)
        (out / "comparison.json").write_text(json.dumps(numbers, indent=1) + "\n")
    if kind == "ablations":
        keys = dict.fromkeys(a.overrides[0].split("=")[0] for a in arms[1:])
        extra = ("The baseline arm is the config as is (" + ", ".join(f"`{k}={_get(base, k)}`" for k in keys) +
                 "); every other arm changes one key. One seed per arm: differences of a few points of exact match "
                 "are within run-to-run noise at this scale.")
    report = write_report(kind, runs, out, command, extra)
    return finish(report, runs)


def _cmd_bench_seeds(args: argparse.Namespace, kind: str, arms: list[Arm], base: Config, out: Path,
                     command: str) -> int:
    """``--seeds``: every arm per seed and a report over seeds (``driver.bench.seeds``). The staleness sweep gives
    every arm room for ``(max eta + 1)`` batches in flight (``rollout.max_concurrent_episodes``), so that the
    admission rule, not the episode slots, is what bounds how far generation runs ahead: each eta can be reached."""
    from driver.bench import seeds as bench_seeds

    try:
        seeds = bench_seeds.parse_seeds(args.seeds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if kind == "staleness":
        per_version = base.learner.batch_size * base.weight_sync.every_steps
        slots = -(-(max(int(a.overrides[0].split("=")[1]) for a in arms) + 1) * per_version
                  // base.rollout.num_actors)
        overrides.append(f"rollout.max_concurrent_episodes={max(slots, base.rollout.max_concurrent_episodes)}")
    reference = {"sync": lambda a: True, "staleness": lambda a: "ppo" not in a.name,
                 "ablations": lambda a: True}[kind]
    runs = bench_seeds.run_seeds(args.config, overrides, arms, out, seeds, args.steps, args.eval_every, args.force,
                                 Path(args.warm_starts) if args.warm_starts else None,
                                 report_only=args.report_only)
    report = bench_seeds.write_seeds_report(kind, arms, runs, out, command, reference)
    return finish(report, [r for rs in runs.values() for r in rs])


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="short trainings side by side: staleness sweep, ablations, async vs "
                                  "sync, RL against more SFT over several worlds")
    kinds = bench.add_subparsers(dest="kind", required=True)
    helps = {"staleness": "one training per max_staleness (eta): throughput and reward",
             "ablations": "one training per switch of the seeds' studies, against one baseline",
             "sync": "asynchronous against synchronous (lockstep, eta=0) training",
             "learning": "per seed (own world): RL from the warm start against more SFT for the same time"}
    for kind, text in helps.items():
        p = kinds.add_parser(kind, help=text)
        p.add_argument("--config", required=True, help="YAML config file (configs/*.yaml)")
        p.add_argument("--out", help=f"output folder (default runs/bench/{kind})")
        p.add_argument("--steps", type=int, help="learner steps per arm (default learner.total_steps)")
        p.add_argument("--eval-every", type=int, help="held-out evaluation every k steps (default steps/4)")
        p.add_argument("--force", action="store_true", help="rerun arms whose finished run folder is present")
        p.add_argument("--warm-starts", help="folder of the shared SFT warm starts (default OUT/../warm_start)")
        p.add_argument("--report-only", action="store_true", help="train nothing: report the finished arms "
                       "(those not run yet are listed as such), e.g. while a long study is unfinished")
        if kind != "learning":
            p.add_argument("--seeds", help="comma-separated seeds: every arm on each seed's own world, tiny model and "
                           "warm start, reported as mean and standard error (default: the config's world, once); "
                           "with it, bench staleness adds a standard-PPO arm at the largest eta")
        if kind == "staleness":
            p.add_argument("--etas", default="0,1,2,4,8", help="comma-separated max_staleness values")
            p.add_argument("--ppo-arm", action=argparse.BooleanOptionalAction, default=True,
                           help="with --seeds, the standard-PPO arm at the largest eta (--no-ppo-arm: none, e.g. "
                           "when one study runs once per algorithm.proximal mode)")
        elif kind == "ablations":
            p.add_argument("--studies", default=",".join(DEFAULT_STUDIES),
                           help=f"comma-separated, from {', '.join(STUDIES)}")
        elif kind == "sync":
            p.add_argument("--eta", type=int, default=2, help="the asynchronous arm's max_staleness")
        else:
            p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds: a world and two arms each "
                           "('' for none)")
            p.add_argument("--warm-start-seeds", default="", help="comma-separated sft.seed values: arms on the "
                           "config's own world that differ only by their warm start")
            p.add_argument("--sft-threads", default="", help="comma-separated thread counts: the first warm-start "
                           "seed's warm start computed at each (e.g. 1,2)")
            p.add_argument("--rl-only", action="store_true", help="no SFT-only arm (its columns are left empty)")
        p.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. learner.lr=3e-4")
        p.set_defaults(func=cmd_learning if kind == "learning" else cmd_bench)
    p = kinds.add_parser("continue-sft", help="(bench learning's SFT-only arm) more SFT from a warm start for a time "
                         "budget, on fresh demonstrations")
    p.add_argument("--config", required=True, help="the config the warm start was made with")
    p.add_argument("--warm-start", required=True, help="folder of a finished warm start (async-agent-rl sft)")
    p.add_argument("--seconds", type=float, required=True, help="wall-time budget")
    p.add_argument("--out", required=True, help="where the model, sft_metrics.jsonl and the summary go")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for the warm start")
    p.set_defaults(func=cmd_continue_sft)
