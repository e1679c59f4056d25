"""``async-agent-rl``: the one command-line entry point.

Subcommands (``async-agent-rl COMMAND --help`` for each)::

    config show      print the resolved config; non-zero exit on a bad one
    data make-world  generate the embedded search world (corpus + train/test parquet)
    data import-wiki turn the offline Wikipedia summaries into a wiki-18 style corpus
    model init       build a tiny Qwen2 model + BPE tokenizer from a config
    retriever ...    serve / index a Search-R1-compatible retrieval server
    prepare          world + model for a config, idempotent (what the README's run command does first)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from async_agent_rl.config import Config, ConfigError, load_config


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
    print(f"tiny Qwen2 model ({cfg.model.init.hidden_size}x{cfg.model.init.num_hidden_layers}) -> {out}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from async_agent_rl.prepare import prepare

    cfg = _config(args)
    for line in prepare(cfg, force=args.force):
        print(line)
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
    mi = model.add_parser("init", help="build a tiny Qwen2 model and tokenizer from the config")
    mi.add_argument("--out", help="output folder (default: model.path)")
    mi.add_argument("--corpus", help="train the tokenizer on this corpus (default: data.corpus_file if present)")
    _add_config_args(mi)
    mi.set_defaults(func=cmd_model_init)

    prep = sub.add_parser("prepare", help="make the world and the tiny model for a config if missing")
    prep.add_argument("--force", action="store_true", help="rebuild even if present")
    _add_config_args(prep)
    prep.set_defaults(func=cmd_prepare)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
