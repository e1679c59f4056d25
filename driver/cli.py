"""``async-agent-rl``: the one command-line entry point.

Subcommands (``async-agent-rl COMMAND --help`` for each)::

    config show      print the resolved config; non-zero exit on a bad one
    data make-world  generate the embedded search world (corpus + train/test parquet)
    data import-wiki turn the offline Wikipedia summaries into a wiki-18 style corpus
    model init       build a tiny Qwen2 (or Qwen3) model + BPE tokenizer from a config
    retriever ...    serve / index a Search-R1-compatible retrieval server
    prepare          world + model for a config, idempotent (what the README's run command does first)
    rollout          run episodes with the current model and write them as JSON lines
    show             print episodes turn by turn, observations marked, with the loss mask
    view             a run's curves and training episodes as a page on 127.0.0.1, during or after the run
    sft              supervised warm start on generated demonstration episodes
    train            the whole asynchronous system on Ray (the main job); --dry-run: check a config first
    eval             greedy exact match / F1 / searches / turns of a checkpoint on held-out questions
    probe            what a checkpoint does at each turn of the expert's episode (search? which query? reads?)
    bench            short trainings side by side: staleness sweep, ablations, async vs sync
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from async_agent_rl.config import Config, ConfigError, config_reference, load_config
from async_agent_rl.errors import InputError, error_line
from async_agent_rl.stats import RolloutStats

# Each command imports what it needs inside its handler, so that `config show` or `retriever serve` does not pay
# for (or fail on) Ray, torch, DeepSpeed or vLLM.


def _add_config_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--config", required=required, help="YAML config file (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.clip_ratio_high=0.28")


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


# ------------------------------------------------------------------------------------------------------ handlers
def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = _config(args)
    print(json.dumps(cfg.to_dict(), indent=2) if args.json else cfg.to_yaml(), end="" if not args.json else "\n")
    return 0


def cmd_make_world(args: argparse.Namespace) -> int:
    from async_agent_rl.data.world import generate_world, write_world

    cfg = _config(args)
    world_cfg = cfg.data.world.model_copy(update={"seed": args.seed} if args.seed is not None else {})
    out = Path(args.out or cfg.data.world_dir)
    world = generate_world(world_cfg)
    paths = write_world(world, out, template=cfg.data.prompt_template)
    n2 = sum(q.hops == 2 for q in world.train + world.test)
    print(
        f"world (seed {world_cfg.seed}): {len(world.entities)} passages, {len(world.train)} train and "
        f"{len(world.test)} test questions ({n2} bridge) -> {out}"
    )
    for name, p in paths.items():
        print(f"  {name:9s} {p}")
    return 0


def cmd_import_wiki(args: argparse.Namespace) -> int:
    from async_agent_rl.data.corpus import import_wiki_offline

    n = import_wiki_offline(args.out, limit=args.limit)
    print(f"wrote {n} Wikipedia summary passages -> {args.out}")
    return 0


def cmd_model_init(args: argparse.Namespace) -> int:
    from async_agent_rl.tiny_model import init_tiny_model

    cfg = _config(args)
    out = Path(args.out or cfg.model.path)
    corpus = args.corpus or (cfg.data.corpus_file if Path(cfg.data.corpus_file).is_file() else None)
    init_tiny_model(out, cfg.model.init, corpus)
    print(f"tiny {cfg.model.init.architecture} model ({cfg.model.init.hidden_size}x{cfg.model.init.num_hidden_layers}) -> {out}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from driver.prepare import prepare

    cfg = _config(args)
    for line in prepare(cfg, force=args.force):
        print(line)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.dry_run:
        return cmd_train_dry_run(args)
    from driver.train import Trainer

    if args.resume:
        if args.config or args.overrides:
            raise ConfigError("--resume takes the run's own config.yaml; do not pass --config or overrides with it")
        trainer = Trainer.resume(args.resume)
    else:
        trainer = Trainer(_config(args))
    summary = trainer.run()
    if summary.get("stopped_by"):  # SIGINT or SIGTERM: a checkpoint and one closing line, the shell's exit status
        return 128 + abs(summary["stopped_by"])
    return 0 if summary.get("steps", 0) >= trainer.cfg.learner.total_steps else 1


def cmd_train_dry_run(args: argparse.Namespace) -> int:
    from driver.check import dry_run

    if args.resume:
        raise ConfigError("--dry-run checks a --config; it does not take --resume")
    report = dry_run(_config(args))
    print(f"dry run of {args.config or 'the default config'}: nothing started, nothing written")
    for line in report.lines:
        print(f"  {line}")
    for problem in report.problems:
        print(f"error: {problem}", file=sys.stderr)
    print(f"{len(report.problems)} problem(s)" if report.problems else "ok: nothing missing that can be checked here")
    return 2 if report.problems else 0


def _at_least_one(value: int | None, flag: str) -> bool:
    """False (after one ``error:`` line) when a count given on the command line is below 1."""
    if value is not None and value < 1:
        print(f"error: {flag} must be at least 1, got {value}", file=sys.stderr)
        return False
    return True


def _check_weights(model: str, what: str) -> None:
    """Refuse a model folder whose safetensors weights are damaged (truncated, padded, a shard missing) before an
    engine is started on it: the engine's own failure is a traceback ending in "Engine core initialization failed"
    that names no file."""
    from driver.check import model_weights_problems

    problems = model_weights_problems(Path(model))
    if problems:
        more = f" (and {len(problems) - 1} more damaged file(s))" if len(problems) > 1 else ""
        raise InputError(f"{what} {problems[0]}{more}")


def cmd_rollout(args: argparse.Namespace) -> int:
    import asyncio

    from actors.rollout_worker import PromptSource, RolloutWorker
    from actors.stack import local_stack, write_episodes
    from async_agent_rl.data.search_r1 import read_qa_files
    from driver.prepare import prepare

    if not _at_least_one(args.num_episodes, "--num-episodes"):
        return 2

    cfg = _config(args)
    for line in prepare(cfg):
        print(line)
    files = [args.data] if args.data else cfg.data.train_files
    examples, _ = read_qa_files(files, cfg.data.on_bad_row)
    model = args.model or cfg.model.path
    _check_weights(model, "--model" if args.model else "model.path")
    out: list = []

    async def sink(batch: list) -> None:
        out.extend(batch)

    async def main() -> RolloutStats:
        async with local_stack(cfg, model) as stack:
            worker = RolloutWorker(
                stack.runner,
                iter(PromptSource(examples, seed=cfg.data.seed, shuffle=cfg.data.shuffle)),
                sink,
                group_size=cfg.rollout.group_size,
                max_concurrent=cfg.rollout.max_concurrent_episodes,
                seed=cfg.rollout.seed,
            )
            groups = -(-args.num_episodes // cfg.rollout.group_size)
            return (await worker.run(num_groups=groups)).message()

    stats = asyncio.run(main())
    n = write_episodes(args.out, out[: args.num_episodes], model)
    rate = stats.finished / max(stats.elapsed_s, 1e-9)
    print(
        f"{n} episodes -> {args.out}  ({rate:.2f} episodes/s, {stats.generated_tokens} generated tokens, "
        f"mean reward {stats.reward_sum / max(stats.finished, 1):.3f}, finish {stats.finish_reasons})"
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from actors.stack import read_episodes
    from driver.show import format_trajectory

    if not _at_least_one(args.limit, "--limit"):
        return 2

    trajs = read_episodes(args.file)
    if not trajs:
        raise InputError(f"{args.file}: no episodes in the file")
    if args.index is not None and not -len(trajs) <= args.index < len(trajs):
        raise InputError(f"--index {args.index}: {args.file} holds {len(trajs)} episodes")
    picked = trajs if args.index is None else [trajs[args.index]]
    tok_dir = args.tokenizer or picked[0].meta.extra.get("model")
    if not tok_dir:
        print("error: no --tokenizer given and the file does not record its model folder", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for t in picked[: args.limit]:
        print(format_trajectory(t, tok, tokens=args.tokens))
        print()
    return 0


def _checkpoint(args: argparse.Namespace, cfg: Config) -> str:
    """The model folder ``--checkpoint`` (else ``model.path``) names, checked: a local folder with a config and whole
    weights (never a Hugging Face Hub repo id)."""
    model = args.checkpoint or cfg.model.path
    what = "--checkpoint" if args.checkpoint else "model.path"
    if not (Path(model) / "config.json").is_file():
        raise InputError(f"{what} {model}: no model folder there (no config.json)")
    _check_weights(model, what)
    return model


def cmd_eval(args: argparse.Namespace) -> int:
    import asyncio

    from actors.stack import local_stack, run_greedy, score_episodes, write_episodes
    from async_agent_rl.data.search_r1 import read_qa_files

    if not _at_least_one(args.limit, "--limit"):
        return 2
    cfg = _config(args)
    model = _checkpoint(args, cfg)
    examples, _ = read_qa_files([args.data] if args.data else cfg.data.test_files, cfg.data.on_bad_row)
    examples = examples[: args.limit] if args.limit else examples

    async def main():
        async with local_stack(cfg, model) as stack:
            fitting, too_long = stack.runner.split_by_prompt_length(examples)
            trajs = await run_greedy(stack.runner, fitting)
            return trajs, score_episodes(trajs, stack.runner.tokenizer, skipped_too_long=len(too_long))

    trajs, scores = asyncio.run(main())
    if not trajs:
        raise InputError(f"no question could be evaluated: all {len(examples)} prompts are longer than "
                         f"data.max_prompt_length={cfg.data.max_prompt_length}")
    if args.episodes:
        write_episodes(args.episodes, trajs, model)
    text = json.dumps({"checkpoint": str(model), "scores": scores}, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from warm_start.probe import probe, probe_table, write_probe

    if not _at_least_one(args.limit, "--limit"):
        return 2
    cfg = _config(args)
    model = _checkpoint(args, cfg)
    result = probe(cfg, model, limit=args.limit or 0)
    if not result["kinds"]:
        raise InputError(f"no held-out question could be probed (not the embedded world's questions?): "
                         f"{result['skipped'] or 'none read'}")
    print(probe_table(result))
    if args.out:
        print(f"[probe] -> {write_probe(result, args.out)}")
    return 0


# --------------------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="async-agent-rl", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="inspect configs").add_subparsers(dest="action", required=True)
    show = p.add_parser("show", help="print the resolved config (exit 2 on a bad one)")
    _add_config_args(show)
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_config_show)
    ref = p.add_parser("reference", help="print the Markdown reference of every config key (docs/CONFIG.md)")
    ref.set_defaults(func=lambda args: print(config_reference()) or 0)

    data = sub.add_parser("data", help="datasets and corpora").add_subparsers(dest="action", required=True)
    mw = data.add_parser("make-world", help="generate the embedded search world")
    mw.add_argument("--out", help="output folder (default: data.world_dir)")
    mw.add_argument("--seed", type=int, help="overrides data.world.seed")
    _add_config_args(mw)
    mw.set_defaults(func=cmd_make_world)
    iw = data.add_parser("import-wiki", help="offline Wikipedia summaries -> wiki-18 style corpus.jsonl")
    iw.add_argument("--out", required=True)
    iw.add_argument("--limit", type=int)
    iw.set_defaults(func=cmd_import_wiki)

    model = sub.add_parser("model", help="models").add_subparsers(dest="action", required=True)
    mi = model.add_parser("init", help="build a tiny Qwen2 (or Qwen3) model and tokenizer from the config")
    mi.add_argument("--out", help="output folder (default: model.path)")
    mi.add_argument("--corpus", help="train the tokenizer on this corpus (default: data.corpus_file if present)")
    _add_config_args(mi)
    mi.set_defaults(func=cmd_model_init)

    prep = sub.add_parser("prepare", help="make the world and the tiny model for a config if missing")
    prep.add_argument("--force", action="store_true", help="rebuild even if present")
    _add_config_args(prep)
    prep.set_defaults(func=cmd_prepare)

    tr = sub.add_parser("train", help="asynchronous RL on Ray: retriever, buffer, rollout actors, learner")
    tr.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest checkpoint")
    tr.add_argument("--dry-run", action="store_true", help="report what the run needs (model and data paths, "
                    "retriever, vLLM, GPUs and memory) and exit without starting anything")
    _add_config_args(tr)
    tr.set_defaults(func=cmd_train)

    ro = sub.add_parser("rollout", help="run episodes with the current model, write JSON lines")
    ro.add_argument("--num-episodes", type=int, default=8)
    ro.add_argument("--out", default="episodes.jsonl")
    ro.add_argument("--model", help="model folder (default: model.path)")
    ro.add_argument("--data", help="parquet file of questions (default: data.train_files)")
    _add_config_args(ro)
    ro.set_defaults(func=cmd_rollout)

    sh = sub.add_parser("show", help="print episodes turn by turn with the loss mask")
    sh.add_argument("file", help="episodes.jsonl written by rollout or eval")
    sh.add_argument("--index", type=int, help="only this episode")
    sh.add_argument("--limit", type=int, default=1, help="at most this many episodes (default 1)")
    sh.add_argument("--tokens", action="store_true", help="one line per token: id, piece, mask, version, log-prob")
    sh.add_argument("--tokenizer", help="tokenizer folder (default: the model recorded in the file)")
    sh.set_defaults(func=cmd_show)

    ev = sub.add_parser("eval", help="greedy evaluation on held-out questions")
    ev.add_argument("--checkpoint", help="model folder (default: model.path)")
    ev.add_argument("--data", help="parquet file (default: data.test_files)")
    ev.add_argument("--limit", type=int, help="first N questions only")
    ev.add_argument("--out", help="write the scores as JSON here")
    ev.add_argument("--episodes", help="write the episodes as JSON lines here")
    _add_config_args(ev)
    ev.set_defaults(func=cmd_eval)
    pr = sub.add_parser("probe", help="greedy decisions turn by turn on the expert's episodes (embedded world)")
    pr.add_argument("--checkpoint", help="model folder (default: model.path)")
    pr.add_argument("--limit", type=int, help="first N held-out questions only")
    pr.add_argument("--out", help="folder for probe.md, probe.json and the per-question turns")
    _add_config_args(pr)
    pr.set_defaults(func=cmd_probe)

    from driver.bench.cli import register as register_bench
    from driver.sft_cli import register as register_sft
    from driver.view import register as register_view
    from retriever.cli import register as register_retriever

    register_retriever(sub)
    register_sft(sub)
    register_bench(sub)
    register_view(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rc = 2
    train = sys.modules.get("driver.train")
    if train is not None:  # a stuck shutdown of an earlier call in this process (tests call main in process) is not ours
        train.ray_shutdown_stuck = False
    try:
        rc = _run(args)
    finally:
        train = sys.modules.get("driver.train")
        if train is not None and train.ray_shutdown_stuck:  # Ray's exit hook would wait on the same stuck call
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    return rc


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # one line on stderr, never a traceback (-v: the traceback of an unexpected one)
        line = error_line(e)
        if line is not None:
            print(line, file=sys.stderr)
            return 2
        if args.verbose:
            raise
        first = str(e).strip().splitlines()
        print(f"error: unexpected {type(e).__name__}: {first[0] if first else ''} (rerun with -v for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
