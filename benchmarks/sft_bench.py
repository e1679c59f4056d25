"""Warm-start training throughput: our loop (``warm_start.sft``) against a bare PyTorch loop, side by side.

    python benchmarks/sft_bench.py                               # ~6 minutes on 2 loaded cores
    python benchmarks/sft_bench.py --before HEAD~1 --threads 1,2  # also the loop of an older commit
    python benchmarks/sft_bench.py --out benchmarks/results/warm_start_throughput/  # also write the run's files there

Both phases of the warm start, on the quickstart config (seed 0's world and tiny model, built into ``--world`` if
missing; the config's batch size 16, 128-token pretraining windows and length-grouped demonstration batches):

- pretraining: ``--pretrain-steps`` steps of next-token LM on the shuffled-world token stream;
- demonstrations: the first ``--sft-steps`` batches of ``epoch_batches`` over ``--demos`` demonstrations.

Arms, each trained from the same initial weights on the SAME batches (same windows, same demonstrations in the same
order, each batch padded to its longest row):

- ``bare``: plain AdamW (same betas, constant LR), forward / loss / backward / step, on batches made before the
  clock starts; the demonstration loss is the same token-mean NLL over model tokens (output head on those positions
  only, as ours), with the attention mask passed as a plain loop would;
- ``ours``: ``warm_start.sft.pretrain_on_texts`` (tokenizing its texts included) and ``warm_start.sft.train_on_demos``
  (packing each batch, LR schedule, grad clipping, per-step metrics included; the rows' common prompt template
  computed once per batch, ``shared_prefix_nll``), at the same fixed thread count;
- ``ours-auto``: the same with ``ThreadTuner.for_machine()`` choosing the thread count, as ``run_sft`` does;
- ``before`` (with ``--before REV``): the same two functions from ``warm_start/sft.py`` at git revision REV.
- ``ours-bf16`` (with ``--bf16``): ``ours`` under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (matrix products
  in bfloat16, which processors with AVX-512 BF16 or AMX run natively; the loss in float32);
- ``ours-math`` (with ``--sdpa-math``): ``ours`` with attention on SDPA's math backend (plain matrix products and
  softmax) instead of its CPU flash kernel;
- ``ours-bN`` (with ``--wide-batch N``, demonstrations only): ``ours`` on batches of N demonstrations (the first
  ``--sft-steps`` x batch size / N batches of ``epoch_batches`` at batch size N): tokens/s at a wider batch.

``--profile`` also prints where ``ours``' demonstration steps spend their time (torch's profiler, top operators by
self CPU time, at the first ``--threads`` count), after the timed rounds.

``--threads`` lists the fixed torch thread counts to run ``bare``, ``ours`` (and ``before``) at. The arms run in
alternation, ``--rounds`` times, so a shared machine's changing load falls on all of them; reported per phase:
tokens/s of each arm (total tokens over total seconds of its rounds; demonstrations: non-padding tokens) and its
ratio to ``bare`` at the same thread count (``ours-auto``: to the faster ``bare``).

``--out DIR`` also writes DIR/result.json (the last JSON line printed: every arm's tokens/s and ratio),
DIR/output.txt (what was printed) and DIR/run.json (command, commit, versions, cores, load average):
``benchmarks/record.py``. Not a folder named ``sft/``: ``.gitignore`` drops those under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

if __package__:  # imported as benchmarks.sft_bench
    from benchmarks import record
else:  # run as python benchmarks/sft_bench.py: this folder is sys.path[0]
    import record

ROOT = Path(__file__).resolve().parents[1]


def load_before(rev: str) -> Any:
    """``warm_start/sft.py`` as it was at git revision ``rev`` (or the file ``rev``), as a module."""
    if Path(rev).is_file():
        return _module_from(Path(rev))
    for where in ("warm_start/sft.py", "learner/sft.py"):  # the warm start lived in learner/ until it had a package
        got = subprocess.run(["git", "show", f"{rev}:{where}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode == 0:
            break
    else:
        raise SystemExit(f"error: no warm_start/sft.py or learner/sft.py at git revision {rev}")
    # an older loop imports the LR schedule from where it lived then
    src = got.stdout.replace("from learner.learner import lr_factor",
                             "from async_agent_rl.lr_schedule import lr_factor")
    with tempfile.TemporaryDirectory(prefix="sft_before_") as tmp:  # loaded, the module needs no file
        path = Path(tmp) / "sft_before.py"
        path.write_text(src)
        return _module_from(path)


def _module_from(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("sft_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bare_pretrain(model: Any, windows: list[torch.Tensor], lr: float) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    head = model.get_output_embeddings()
    model.train()
    for x in windows:
        hidden = model.base_model(input_ids=x, use_cache=False).last_hidden_state[:, :-1]
        loss = F.cross_entropy(head(hidden).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def bare_sft(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], lr: float) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    head = model.get_output_embeddings()
    model.train()
    for input_ids, attention_mask, sel in batches:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        loss = F.cross_entropy(head(hidden[:, :-1][sel]), input_ids[:, 1:][sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def profile_table(run: Callable[[Any], None], model0: Any, threads: int, rows: int = 20) -> str:
    """``run`` on a copy of ``model0`` under torch's profiler at ``threads`` threads: the top ``rows`` operators
    by self CPU time, as torch prints them."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    model = copy.deepcopy(model0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(model)
    return f"profile of ours' demonstration steps at {threads} threads:\n" + \
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--world", default="runs/sft_bench/world", help="world + model folder (built if missing)")
    ap.add_argument("--pretrain-steps", type=int, default=16)
    ap.add_argument("--sft-steps", type=int, default=24)
    ap.add_argument("--demos", type=int, default=800)
    ap.add_argument("--threads", default="1", help="fixed torch thread counts for bare/ours/before, e.g. 1,2")
    ap.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True, help="run ours-auto")
    ap.add_argument("--before", help="git revision (or file) whose warm_start/sft.py loop also runs (e.g. HEAD~1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also ours under bfloat16 autocast (arm ours-bf16)")
    ap.add_argument("--sdpa-math", action="store_true", help="also ours on SDPA's math backend (arm ours-math)")
    ap.add_argument("--wide-batch", type=int, help="also ours on demonstration batches of this size (arm ours-bN)")
    ap.add_argument("--profile", action="store_true", help="print the top operators of ours' demonstration steps")
    record.add_out_argument(ap)
    args = ap.parse_args(argv)
    with record.Recording(args.out, __file__, argv, vars(args)) as rec:
        rec.result = bench(args)
    return 0


def bench(args: argparse.Namespace) -> dict:
    """Every arm in alternation, ``--rounds`` times; prints the table and its JSON line, returns the latter (with
    the steps and tokens of each phase)."""
    import warm_start.sft as ours
    from async_agent_rl.batch import pack_batch
    from async_agent_rl.config import load_config
    from driver.bench.arms import seed_overrides
    from driver.train import prepare
    from transformers import AutoModelForCausalLM, AutoTokenizer

    world = Path(args.world)
    cfg = load_config(args.config, [*seed_overrides(0, world), f"sft.num_demos={args.demos}"])
    for line in prepare(cfg):
        print(f"[prepare] {line}", flush=True)
    s = cfg.sft
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    torch.manual_seed(0)
    model0 = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    before = load_before(args.before) if args.before else None

    texts = ours._pretrain_texts(cfg, args.pretrain_steps, s.batch_size, ours.PRETRAIN_SEQ_LEN, tokenizer)
    windows = list(ours.pretrain_windows(ours.token_stream(tokenizer, texts), args.pretrain_steps, s.batch_size,
                                         ours.PRETRAIN_SEQ_LEN, s.seed))
    demos, _ = ours.build_demonstrations(cfg, tokenizer)
    plan = ours.epoch_batches([d.total_length for d in demos], s.batch_size, 1, s.seed)[: args.sft_steps]
    packed = [pack_batch([demos[i] for i in rows], pad_id) for rows in plan]
    sft_batches = [(b.input_ids, b.attention_mask, b.loss_mask[:, 1:] > 0) for b in packed]
    pre_tokens = sum(x.numel() for x in windows)
    sft_tokens = sum(int(b.attention_mask.sum()) for b in packed)
    padding = 1 - sft_tokens / sum(b.attention_mask.numel() for b in packed)
    print(f"pretraining: {len(windows)} steps of {tuple(windows[0].shape)}, {pre_tokens} tokens; demonstrations: "
          f"{len(plan)} steps, {sft_tokens} tokens, {100 * padding:.1f}% padding; rounds {args.rounds}", flush=True)

    def lib_pretrain(mod: Any, tuner: Any = None) -> Callable[[Any], None]:
        def run(model: Any) -> None:
            kw = {"threads": tuner()} if tuner else {}
            mod.pretrain_on_texts(model, tokenizer, texts, args.pretrain_steps, s.batch_size, s.lr, s.warmup_steps,
                                  s.seed, ours.PRETRAIN_SEQ_LEN, **kw)
        return run

    def lib_sft(mod: Any, tuner: Any = None, plan: list = plan) -> Callable[[Any], None]:
        def run(model: Any) -> None:
            kw = {"threads": tuner()} if tuner else {}
            mod.train_on_demos(model, demos, plan, s.lr, s.warmup_steps, pad_id, lambda m: None, **kw)
        return run

    def bf16(run: Callable[[Any], None]) -> Callable[[Any], None]:
        def autocast_run(model: Any) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                run(model)
        return autocast_run

    def math_sdpa(run: Callable[[Any], None]) -> Callable[[Any], None]:
        def math_run(model: Any) -> None:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.MATH):
                run(model)
        return math_run

    wide_plan: list = []
    tokens_of = {"pretrain": pre_tokens, "sft": sft_tokens}  # per arm name where it differs (ours-bN)
    if args.wide_batch:
        n = max(1, len(plan) * s.batch_size // args.wide_batch)
        wide_plan = ours.epoch_batches([d.total_length for d in demos], args.wide_batch, 1, s.seed)[:n]
        tokens_of[f"ours-b{args.wide_batch}"] = sum(demos[i].total_length for rows in wide_plan for i in rows)

    threads = [int(t) for t in args.threads.split(",")]
    arms: list[tuple[str, int | None, str, Callable[[Any], None]]] = []  # (name, threads, phase, run)
    for t in threads:
        arms += [("bare", t, "pretrain", lambda m: bare_pretrain(m, windows, s.lr)),
                 ("bare", t, "sft", lambda m: bare_sft(m, sft_batches, s.lr)),
                 ("ours", t, "pretrain", lib_pretrain(ours)), ("ours", t, "sft", lib_sft(ours))]
        if before:
            arms += [("before", t, "pretrain", lib_pretrain(before)), ("before", t, "sft", lib_sft(before))]
        if args.bf16:
            arms += [("ours-bf16", t, "pretrain", bf16(lib_pretrain(ours))), ("ours-bf16", t, "sft", bf16(lib_sft(ours)))]
        if args.sdpa_math:
            arms += [("ours-math", t, "pretrain", math_sdpa(lib_pretrain(ours))),
                     ("ours-math", t, "sft", math_sdpa(lib_sft(ours)))]
        if args.wide_batch:
            arms += [(f"ours-b{args.wide_batch}", t, "sft", lib_sft(ours, plan=wide_plan))]
    if args.auto:
        arms += [("ours-auto", None, "pretrain", lib_pretrain(ours, ours.ThreadTuner.for_machine)),
                 ("ours-auto", None, "sft", lib_sft(ours, ours.ThreadTuner.for_machine))]

    seconds: dict[tuple[str, int | None, str], float] = {}
    default_threads = torch.get_num_threads()
    for t in threads:  # warm-up (first-call allocations), not timed
        torch.set_num_threads(t)
        bare_pretrain(copy.deepcopy(model0), windows[:2], s.lr)
        bare_sft(copy.deepcopy(model0), sft_batches[:2], s.lr)
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        for name, t, phase, run in order:
            torch.set_num_threads(t or default_threads)
            model = copy.deepcopy(model0)
            t0 = time.perf_counter()
            run(model)
            seconds[(name, t, phase)] = seconds.get((name, t, phase), 0.0) + time.perf_counter() - t0
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    torch.set_num_threads(default_threads)

    results = []
    for phase in ("pretrain", "sft"):
        rates = {(n, t): args.rounds * tokens_of.get(n, tokens_of[phase]) / sec
                 for (n, t, ph), sec in seconds.items() if ph == phase}
        best_bare = max(v for (n, _), v in rates.items() if n == "bare")
        for (n, t), rate in rates.items():
            ref = best_bare if t is None else rates[("bare", t)]
            results.append({"phase": phase, "arm": n, "threads": t if t is not None else "auto",
                            "tokens_per_s": round(rate, 1), "ratio_to_bare": round(rate / ref, 3)})
    print(f"{'phase':9s} {'arm':10s} {'threads':>7s} {'tokens/s':>10s} {'/ bare':>7s}")
    for row in results:
        print(f"{row['phase']:9s} {row['arm']:10s} {str(row['threads']):>7s} {row['tokens_per_s']:10,.0f} "
              f"{row['ratio_to_bare']:7.3f}")
    if args.profile:
        print(profile_table(lambda m: lib_sft(ours)(m), model0, threads[0]), flush=True)
    summary = {"bench": "sft", "rounds": args.rounds, "padding": round(padding, 4), "results": results}
    print(json.dumps(summary))
    return summary | {"pretrain_steps": len(windows), "pretrain_tokens": pre_tokens, "sft_steps": len(plan),
                      "sft_tokens": sft_tokens}


if __name__ == "__main__":
    sys.exit(main())
