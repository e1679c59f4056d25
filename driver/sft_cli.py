"""``async-agent-rl sft``: the supervised warm start from generated demonstration episodes (``warm_start.sft``).

    async-agent-rl sft --config configs/quickstart.yaml [--out DIR] [--pretrain-steps N] [sft.epochs=3 ...]

Reads the model at ``model.path``; optionally runs N steps of next-token pretraining on shuffled-fact observations of
the world (a random-init model needs them to learn copying names; see ``warm_start.sft.run_sft``); demonstrates
``sft.num_demos`` train questions with the configured retriever and trains on them; writes the fine-tuned model +
tokenizer (``save_pretrained``), ``sft_config.yaml``, ``sft_metrics.jsonl`` and ``sft_summary.json`` to ``--out``
(default ``<run_dir>/sft``). Point ``model.path`` of the RL run at that folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from async_agent_rl.config import load_config


def cmd_sft(args: argparse.Namespace) -> int:
    from warm_start.sft import run_sft  # here, not at the top: the CLI imports this module for every command

    cfg = load_config(args.config, args.overrides)
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        print(f"error: model.path {model_dir} holds no model (run `async-agent-rl prepare` first)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else cfg.run_dir / "sft"
    cfg.save(out / "sft_config.yaml")
    s = run_sft(cfg, model_dir, out, pretrain_steps=args.pretrain_steps)
    print(summary_text(s))
    return 0


def summary_text(s: dict) -> str:
    """Human-readable lines for a ``run_sft`` summary."""
    failures = ", ".join(f"{k} {v}" for k, v in s["demo_failures"].items()) or "none"
    lines = [
        f"sft: {s['demos']} demonstrations ({s['single_hop_demos']} single-hop, {s['bridge_demos']} bridge; "
        f"not demonstrable: {failures})"
    ]
    if s["pretrain_steps"]:
        lines.append(
            f"     corpus pretraining: {s['pretrain_steps']} steps, loss -> {s['pretrain_final_loss']:.3f} "
            f"({s['pretrain_seconds']:.1f}s)"
        )
    lines.append(
        f"     demonstrations: {s['steps']} steps, {s['epochs']} epoch(s), loss {s['first_loss']:.3f} -> "
        f"{s['final_loss']:.3f} ({s['tokens_per_s']:.0f} tokens/s); {s['seconds']:.1f}s in all"
    )
    lines.append(f"     warm-start model -> {s['out_dir']}")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``sft --config FILE [--out DIR] [overrides]`` to the CLI's subparsers."""
    p = subparsers.add_parser("sft", help="supervised warm start from generated demonstration episodes")
    p.add_argument("--config", required=True, help="YAML config file (configs/*.yaml)")
    p.add_argument("--out", help="output folder (default: <run.output_dir>/<run.name>/sft)")
    p.add_argument(
        "--pretrain-steps", type=int, default=None,
        help="next-token steps on shuffled-fact world observations before SFT (default: sft.pretrain_steps if "
        "the config has it, else 0; 300 for the quickstart)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.epochs=3")
    p.set_defaults(func=cmd_sft)
    return p
