"""The whole system learns what the default run learns: a short asynchronous RL run (Ray, vLLM CPU actor, BM25
server, buffer, DeepSpeed learner, weight publishing) makes the agent search, which is what its reward pays for, and
the held-out greedy agent answers more questions right.

The warm start is the quickstart's recipe, shortened and without its reading exercises: shuffled-world pretraining
(300 steps of 128-token windows, ``sft.pretrain_questions=false``), then one epoch over 20000 demonstrations of the imperfect expert (half of them answer without searching, half of the searching bridge
ones stop after one search). Greedy, it never searches on held-out questions (EM about 0.03, lucky guesses). The RL
part is the quickstart's with a higher learning rate (5e-4) for 24 steps.

The criteria, statistical:

- the sampled policy searches more, step after step: the per-step searches per episode (the learning signal the
  driver records) have a least-squares slope > 0 with t > 4 (measured: t = 12.8, 0.30 -> 1.06 per episode);
- on held-out questions (greedy, every one, subjects never seen in training) searches per question rise by at least
  0.5 (measured 0.00 -> 1.20) and exact match rises by at least 0.10 (measured 0.033 -> 0.268), with far more
  questions turned right than wrong (exact one-sided sign test on the paired questions, p < 0.001; measured 145
  gained, 15 lost).

Why without the reading exercises: this test is about the system's learning machinery on one short warm start, and
it was measured and passed CI in this form; with the exercises at 300 pretraining steps one run measured 0.033 ->
0.125 (below the bar), and one at 500 steps ran past the time limit beside other work, unmeasured. How well the
shipped recipe learns is a statistic over warm starts and worlds: ``bench learning`` (benchmarks/RESULTS.md,
"Learning on every warm start"), not one test run.

The measured figures are of the warm start committed on 2026-11-28; the one committed since ad0d94b (BM25 ties by
corpus position change its demonstrations) passes the same bars.
The warm start is committed (``tests/data/learns_warm_start/``, ~3 MB; made by ``python -m
tests.integration.test_train_learns``, about 6 minutes): it is what this recipe's SFT makes on the test world, and
training it again in every CI run cost 6 of its 90 minutes. Its ``fingerprint.json`` holds the warm start's
resolved inputs (paths aside) and hashes of the world's files; when the world or the recipe changed, the test
trains the warm start again in its own run (as before) and says so. RL from one fixed warm start also takes away
one source of the machine-to-machine spread (the warm start's float rounding).

History: before the engine's tied output head followed the published weights (actors/vllm_worker.py), the same run
moved held-out EM 0.033 -> 0.034 and greedy searches 0.00 -> 0.00 (the engine's logits lagged the learner), and this
test asked only for behaviour trends; CI once failed it there. With ``learner.lr`` near 0 (or rewards that never
reach the learner, a loss with the wrong sign, weights that never reach the engine) nothing rises and it fails.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from async_agent_rl.config import Config, load_config
from tests.helpers import TEST_TINY_MODEL, TEST_WORLD, world_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 24
MIN_EM_GAIN = 0.10  # held-out greedy exact match, all questions


WARM_START = REPO / "tests" / "data" / "learns_warm_start"
FINGERPRINT = "fingerprint.json"


def learn_config(output_dir: Path, world_dir: Path, model_dir: Path, *extra: str) -> Config:
    return load_config(REPO / "configs/quickstart.yaml", [
        f"run.output_dir={output_dir}", "run.name=learn", *world_overrides(world_dir, model_dir),
        "sft.num_demos=20000", "sft.pretrain_steps=300", "sft.pretrain_questions=false", "learner.lr=5e-4", f"learner.total_steps={STEPS}",
        "sft.pretrain_packing=windows", "sft.pretrain_answer_weight=1",
        "eval.num_questions=0", "eval.every_steps=0", "monitoring.enabled=false", *extra,
    ])  # fmt: skip


def fingerprint(cfg: Config, world_dir: Path) -> dict:
    """What the warm start depends on, machine-independent: its resolved inputs with the world's and the model's
    folders named by role, the base tiny model's recipe (the session fixture's, not the config's ``model.init``),
    and hashes of the world's contents (the parquet files by their rows, not their bytes). Changes to the code that
    makes a model, a tokenizer or demonstrations from these are not seen: make the warm start again after them."""
    from async_agent_rl.config import TinyModelConfig
    from warm_start.sft import warm_start_inputs

    text = json.dumps(warm_start_inputs(cfg, "MODEL"), sort_keys=True).replace(str(world_dir), "WORLD")
    files = {
        name: hashlib.sha256((world_dir / name).read_bytes()).hexdigest() for name in ("corpus.jsonl", "world.json")
    }
    for name in ("train.parquet", "test.parquet"):
        rows = json.dumps(pq.read_table(world_dir / name).to_pylist(), sort_keys=True, default=str)
        files[name] = hashlib.sha256(rows.encode()).hexdigest()
    inputs = json.loads(text)
    inputs["model"].pop("init")  # the config's model.init builds no model here: the base model is the fixture's
    return {"inputs": inputs, "base_model": TinyModelConfig(**TEST_TINY_MODEL).model_dump(), "world": files}


def committed_warm_start(cfg: Config, world_dir: Path) -> Path | None:
    """The committed warm start when it was made from exactly these inputs, else None."""
    saved = WARM_START / FINGERPRINT
    if saved.is_file() and json.loads(saved.read_text()) == fingerprint(cfg, world_dir):
        return WARM_START
    return None


def make_warm_start(cfg: Config, world_dir: Path, model_dir: Path, out: Path) -> None:
    from warm_start.sft import run_sft

    run_sft(cfg, model_dir, out, progress=False)
    (out / FINGERPRINT).write_text(json.dumps(fingerprint(cfg, world_dir), indent=1, sort_keys=True) + "\n")


def test_rl_makes_the_agent_search_and_answer_more_held_out_questions(tmp_path, world_dir, tiny_model_dir):
    from driver.train import Trainer

    cfg = learn_config(tmp_path, world_dir, tiny_model_dir)
    warm = committed_warm_start(cfg, world_dir)
    if warm is None:  # the world or the recipe changed: the recipe's SFT, in this run (see the module's docstring)
        warnings.warn(
            f"{WARM_START} does not match this world and recipe: training the warm start in this run "
            "(python -m tests.integration.test_train_learns makes it again)",
            stacklevel=1,
        )
        warm = tmp_path / "warm_start"
        make_warm_start(cfg, world_dir, tiny_model_dir, warm)
    cfg = learn_config(tmp_path, world_dir, warm, "sft.enabled=false")
    summary = Trainer(cfg, quiet=True).run()
    assert summary["steps"] == STEPS
    run_dir = tmp_path / "learn"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    searches = [searches_per_episode(r["learning"]["by_kind"]) for r in rows]
    slope, t = trend(searches)
    start, end = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    n = start["all"]["n"]
    assert n == end["all"]["n"] > 500  # every held-out question, both times
    before, after = set(start["all"]["correct"]), set(end["all"]["correct"])
    gained, lost = len(after - before), len(before - after)
    report = (
        f"rollout searches/episode {searches[0]:.2f} -> {searches[-1]:.2f} (slope {slope:.4f}, t {t:.1f}); "
        f"held-out searches/q {start['all']['searches_per_question']:.2f} -> "
        f"{end['all']['searches_per_question']:.2f}, EM {start['all']['exact_match']:.3f} -> "
        f"{end['all']['exact_match']:.3f} (gained {gained}, lost {lost})"
    )
    assert slope > 0 and t > 4, report
    assert end["all"]["searches_per_question"] >= start["all"]["searches_per_question"] + 0.5, report
    assert end["all"]["exact_match"] >= start["all"]["exact_match"] + MIN_EM_GAIN, report
    assert sign_test_p(gained, lost) < 0.001, report  # significantly more questions right than before


def searches_per_episode(by_kind: dict) -> float:
    """Searches per finished episode over all question kinds of one step's learning record."""
    n = sum(k["episodes"] for k in by_kind.values())
    return sum(k["searches"] * k["episodes"] for k in by_kind.values()) / n


def trend(ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` against their index, and its t statistic."""
    n = len(ys)
    xm, ym = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - xm) ** 2 for x in range(n))
    slope = sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sxx
    resid = [y - ym - slope * (x - xm) for x, y in enumerate(ys)]
    se = (sum(r * r for r in resid) / (n - 2) / sxx) ** 0.5
    return slope, slope / se if se > 0 else float("inf")


def sign_test_p(gained: int, lost: int) -> float:
    """Exact one-sided sign test: P(X >= gained) for X ~ Binomial(gained + lost, 1/2); 1.0 when nothing changed."""
    m = gained + lost
    if m == 0:
        return 1.0
    return sum(math.comb(m, k) for k in range(gained, m + 1)) / 2**m


def test_statistics_arithmetic():
    assert trend([0.0, 1.0, 2.0, 3.0])[0] == 1.0 and trend([0.0, 1.0, 2.0, 3.0])[1] == float("inf")
    assert abs(trend([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])[1]) < 1
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(1, 0) == 0.5
    assert sign_test_p(3, 0) == 0.125
    assert sign_test_p(2, 1) == 0.5  # P(X >= 2), X ~ Bin(3, 1/2) = 4/8
    assert sign_test_p(0, 5) == 1.0
    assert sign_test_p(40, 4) < 1e-7


def main() -> None:
    """Make the committed warm start: the test's world and tiny model (the session fixtures' recipe), then SFT."""
    import tempfile

    from async_agent_rl.config import TinyModelConfig, WorldConfig
    from async_agent_rl.data.world import generate_world, write_world
    from async_agent_rl.tiny_model import init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        world_dir, model_dir, out = Path(tmp) / "world", Path(tmp) / "model", Path(tmp) / "warm_start"
        write_world(generate_world(WorldConfig(**TEST_WORLD)), world_dir, template="minimal")
        init_tiny_model(model_dir, TinyModelConfig(**TEST_TINY_MODEL), world_dir / "corpus.jsonl")
        make_warm_start(learn_config(Path(tmp), world_dir, model_dir), world_dir, model_dir, out)
        shutil.rmtree(WARM_START, ignore_errors=True)
        shutil.copytree(out, WARM_START)
    # what the test does not read and what names this machine's temporary folders (the fingerprint stands for them)
    for name in ("sft_metrics.jsonl", "warm_start_inputs.json"):
        (WARM_START / name).unlink(missing_ok=True)
    summary = json.loads((WARM_START / "sft_summary.json").read_text())
    summary["out_dir"] = str(WARM_START.relative_to(REPO))
    (WARM_START / "sft_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"warm start -> {WARM_START}")


if __name__ == "__main__":
    main()
