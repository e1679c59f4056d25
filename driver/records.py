"""The run's records: one ``metrics.jsonl`` line and one console line per step, the evaluations' ``eval.jsonl`` lines,
and ``summary.json`` at the end.

``Records.step`` is everything a step reports: the monitor, the learning signals and their warnings, where time
idled since the previous step (``IdleStats``: the learner's wait for its batch, the engines' idle time, the
episodes' wait for the search tool), the run's rollout totals (the fleet's), one metrics line and the console line.
A resumed run's records start from the checkpoint's (``driver.restore.Restored``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from async_agent_rl.config import Config
from async_agent_rl.stats import BufferStats, IdleStats, LearnerStats, PublishStats, RolloutStats, idle_stats
from driver.console import LearningSignals, RunLog, duration, eval_brief
from driver.fleet import Fleet, run_totals
from driver.limits import ask
from driver.versions import PolicyVersions

log = logging.getLogger(__name__)

SEARCH_ERROR_WARN_RATE = 0.5  # warn when more than this share of a step's searches failed (at least 4 of them)
SEARCH_WARN_EVERY_S = 60.0


class Records:
    """The run's records (see the module docstring), written through ``log``. ``start`` gives it the started
    components it reads."""

    def __init__(self, cfg: Config, log: RunLog):
        self.cfg, self.log = cfg, log
        self.history: list[dict] = []
        self.learning = LearningSignals()
        self.fleet: Fleet | None = None
        self.versions: PolicyVersions | None = None
        self.buffer: Any = None
        self.mon: Any = None
        self.url = ""
        self.first_step = 0  # the step the RL loop started from (a resumed run: its checkpoint's)
        self._search_warned_at = -SEARCH_WARN_EVERY_S
        self._recorded_at: float | None = None  # when the previous step was recorded (its wall time ends there)
        self._recorded_rollout: dict[int, RolloutStats] = {}  # each actor's stats at that record (idle time since)

    def start(self, fleet: Fleet, versions: PolicyVersions, buffer: Any, mon: Any, url: str, restored: Any = None) -> None:
        """The started components; ``restored``: a resumed run's ``driver.restore.Restored``."""
        self.fleet, self.versions, self.buffer, self.mon, self.url = fleet, versions, buffer, mon, url
        if restored is not None:
            self.history = restored.history
            self.learning.resumed(restored.buffer)  # the counts as the checkpoint had them

    # ------------------------------------------------------------------------------------------------ a step
    def step(self, step: int, metrics: LearnerStats, publish: PublishStats | None, rollout: list[RolloutStats],
             wait_s: float, t0: float) -> None:
        """Everything step ``step`` reports (see the module docstring); ``wait_s``: the learner's wait for its batch;
        ``t0``: when the RL loop started."""
        buffer = ask(self.buffer.stats.remote(), self.cfg.cluster.actor_timeout_s, "the buffer actor")
        now = time.monotonic()
        idle = idle_stats(wait_s, now - (t0 if self._recorded_at is None else self._recorded_at), rollout,
                          self._recorded_rollout)
        self._recorded_at, self._recorded_rollout = now, {r.index: r for r in rollout}
        if self.mon is not None:
            healed = self.mon.heal()  # an exporter whose thread died serves again (not a reason to stop a run)
            if healed:
                self.log.say(f"[fault] {healed}")
            self.mon.observe(rollout=rollout, buffer=buffer, learner=metrics, publish=publish, idle=idle)
        record = self._record(step, metrics, publish, rollout, buffer, idle, time.monotonic() - t0)
        record["batch"] = metrics.batch
        learning = self.learning.update(rollout, buffer, metrics)
        record["learning"] = dataclasses.asdict(learning)
        if self.mon is not None:
            self.mon.learning.update(learning)
        for warning in self.learning.warnings():
            self.log.say(f"[warn] {warning}")
        self._warn_search_errors(record)
        self.history.append(record)
        self.log.write("metrics.jsonl", record)
        self.log.say(self._line(step, record, metrics, time.monotonic() - t0))

    def _line(self, step: int, record: dict, metrics: LearnerStats, elapsed: float) -> str:
        total = self.cfg.learner.total_steps
        done = max(1, step - self.first_step)
        left = elapsed / done * (total - step)  # time left at the pace so far
        flat = record["learning"]["zero_variance_share"]
        return (
            f"step {step:>{len(str(total))}}/{total}  reward {record['batch_reward']:.2f}  "
            f"rollout EM {record['rollout_exact_match']:.2f}  "
            f"entropy {float('nan') if metrics.entropy is None else metrics.entropy:.3f}  "
            f"equal-reward groups {'  -' if flat is None else f'{flat:3.0%}'}  "
            f"stale {metrics.staleness_mean:.1f}/{metrics.staleness_max:.0f}  "
            f"{record['episodes_per_s']:.0f} ep/s  wait {record['sample_wait_s']:.1f}s  left {duration(left)}"
        )

    def _record(self, step: int, metrics: LearnerStats, publish: PublishStats | None, rollout: list[RolloutStats],
                buffer: BufferStats, idle: IdleStats, elapsed: float) -> dict:
        per_actor = {f"actor{r.index}": run_totals(r) for r in rollout}
        run = self.fleet.totals.run()
        finished, em_sum, generated = run.get("finished", 0), run.get("em_sum", 0.0), run.get("generated_tokens", 0)
        searches, search_errors = run.get("searches", 0), run.get("search_errors", 0)
        prev = self.history[-1] if self.history else {"episodes_total": 0, "em_sum_total": 0.0}
        new_eps = finished - prev["episodes_total"]
        return {
            "step": step,
            "version": self.versions.version,
            "elapsed_s": elapsed,
            "batch_reward": metrics.reward_mean,
            "rollout_exact_match": (em_sum - prev["em_sum_total"]) / new_eps if new_eps else prev.get("rollout_exact_match", 0.0),
            "episodes_total": int(finished),
            "em_sum_total": em_sum,
            "generated_tokens_total": generated,
            "searches_total": int(searches),
            "search_errors_total": int(search_errors),
            "episodes_per_s": finished / elapsed if elapsed > 0 else 0.0,
            "gen_tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
            "per_actor": per_actor,
            "actor_restarts": dict(self.fleet.restarts),
            "lost_episodes": self.fleet.lost_episodes,
            **dataclasses.asdict(idle),  # sample_wait_s (the learner's wait for the batch) and the idle shares
            "buffer_size": buffer.size,
            "buffer_evicted": buffer.evicted,
            "buffer_filtered_groups": buffer.filtered_groups,
            "buffer_staleness_histogram": {str(k): v for k, v in buffer.staleness_histogram.items()},
            "buffer_length_tokens": buffer.length_tokens,
            "buffer_length_turns": buffer.length_turns,
            "admission_groups_open": buffer.admission.groups_open,
            "learner": metrics.as_dict(),
            "publish": publish.as_metrics() if publish is not None else {},
        }

    def _warn_search_errors(self, record: dict) -> None:
        """A run whose searches fail (``retriever.url`` pointing nowhere, a retriever down) still trains, on error
        observations: say so while it runs, at most once a minute (the console's ``[warn]`` line; the log file keeps
        it at INFO, so the terminal does not show it twice)."""
        prev = self.history[-1] if self.history else {}
        searches = record["searches_total"] - prev.get("searches_total", 0)
        errors = record["search_errors_total"] - prev.get("search_errors_total", 0)
        now = time.monotonic()
        if searches >= 4 and errors > SEARCH_ERROR_WARN_RATE * searches and now - self._search_warned_at >= SEARCH_WARN_EVERY_S:
            self._search_warned_at = now
            msg = (f"{errors} of {searches} searches failed since the last step (retriever {self.url}); the policy "
                   "trains on error observations")
            log.info(msg)
            self.log.say(f"[warn] {msg}")

    # ------------------------------------------------------------------------------------------------ evaluations
    def eval(self, rec: dict | None, step: int) -> None:
        """An evaluation's record: ``eval.jsonl``, the monitor and one console line (None: nothing to record);
        ``step``: the learner's step now."""
        if rec is None:
            return
        if rec.get("beside"):
            rec["done_at_step"] = step  # the learner's step when it was done: the loop went on meanwhile
        self.log.write("eval.jsonl", rec)
        if self.mon is not None:
            self.mon.eval.update({k: v for k, v in rec.items() if isinstance(v, dict)}, split="heldout",
                                 step=rec["step"])
        overall = rec["all"]
        beside = f", beside training: version {rec['version']}, done at step {step}" if rec.get("beside") else ""
        self.log.say(
            f"[eval {rec['when']}] held-out exact match {overall['exact_match']:.3f}  F1 {overall['f1']:.3f}  "
            f"searches/q {overall['searches_per_question']:.2f}  turns/q {overall['turns_per_question']:.2f}  "
            f"(n={overall['n']}, {rec['seconds']:.0f}s{beside})"
        )

    # ------------------------------------------------------------------------------------------------ the end
    def summary(self, run_dir: str, step: int, start: dict | None, end: dict | None, rollout: list[RolloutStats],
                seconds: float, final: str, evaluations: dict | None) -> dict:
        """``summary.json``; ``evaluations``: the evaluations beside training's counts (None: none ran)."""
        s: dict[str, Any] = {
            "run_dir": run_dir,
            "steps": step,
            "version": self.versions.version,
            "train_seconds": seconds,
            "final_checkpoint": final,
            "final_policy": str(Path(final) / "policy"),
            "episodes": self.history[-1]["episodes_total"] if self.history else 0,
            "episodes_failed": sum(r.failed for r in rollout),
            "dropped_at_stop": sum(r.dropped_at_stop for r in rollout),  # finished, refused by a full buffer at stop
            "searches": self.history[-1]["searches_total"] if self.history else 0,
            "search_errors": self.history[-1]["search_errors_total"] if self.history else 0,
            "actor_restarts": dict(self.fleet.restarts),
            "lost_episodes": self.fleet.lost_episodes,
            "exporter_restarts": self.mon.exporter_restarts if self.mon is not None else 0,
            "retriever_restarts": self.fleet.retriever.restarts if self.fleet.retriever is not None else 0,
        }
        if start:
            s["exact_match_start"] = start["all"]["exact_match"]
            s["eval_start"] = eval_brief(start)
        if end:
            s["exact_match_end"] = end["all"]["exact_match"]
            s["eval_end"] = eval_brief(end)
        if evaluations is not None:
            s.update(evaluations)
        if s["search_errors"] > SEARCH_ERROR_WARN_RATE * s["searches"] > 0:
            self.log.say(f"[warn] {s['search_errors']} of {s['searches']} searches in this run failed")
        return s
