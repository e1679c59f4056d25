"""Evaluations beside training (``eval.beside``): the RL loop does not wait for them.

An evaluation due every ``eval.every_steps`` learner steps normally runs on rollout actor 0 while the loop waits
(``Trainer.evaluate``). Beside training it runs on an engine of its own, the *evaluator* (a rollout actor asked for
the same resources, never given training episodes): ``start`` hands it the learner's weights of that step and their
policy version in one call (``RolloutActor.evaluate_weights``: load, then greedy episodes on the held-out
questions), so the whole evaluation measures one frozen version while the rollout actors and the learner go on.
``poll`` is asked once per step and returns the finished result, tagged with the step and version it measured
(its ``seconds`` are the evaluation's own, timed on the evaluator).

One evaluation runs at a time: one that comes due while another runs is skipped and counted (the first skip says so
in one line, later ones are only counted), so a slow evaluator can never queue up work or hold weights in memory. An
evaluator that fails or exceeds its time limit ends the evaluations beside training in one ``[warn]`` line; the run
goes on, and the end evaluation still runs on rollout actor 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

from async_agent_rl.config import Config
from driver.limits import REPORT_TIMEOUT_S, cause, eval_limit_s


@dataclass
class Pending:
    step: int
    version: int | None
    ref: Any
    started: float


class EvaluationBeside:
    """The evaluator actor's evaluations (see the module docstring). ``say``: the run's console."""

    def __init__(self, cfg: Config, evaluator: Any, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.cfg, self.evaluator, self.say, self.clock = cfg, evaluator, say, clock
        self.limit_s = eval_limit_s(cfg)
        self.pending: Pending | None = None
        self.finished = 0
        self.skipped = 0
        self.failed: str | None = None  # why the evaluations beside training ended early

    def can_start(self, step: int) -> bool:
        """Whether the evaluation due at ``step`` can start now: not when the evaluator failed, nor while another
        runs (then it is skipped and counted, the first skip said in one line). Asked before the weights are
        taken, so a skipped evaluation costs the loop nothing."""
        if self.failed is not None:
            return False
        if self.pending is not None:
            self.skipped += 1
            if self.skipped == 1:
                self.say(f"[eval] the evaluation of step {step} is skipped: the one of step {self.pending.step} is "
                         "still running beside training (later skips are counted in summary.json, evals_skipped)")
            return False
        return True

    def start(self, step: int, version: int | None, weights: Any) -> None:
        """Evaluate ``weights`` (an object ref to the learner's state dict at ``step``; ``version``: the policy
        version they are, None when they were not published: the engine then runs them under its own tag
        ``-step``, so its prefix cache never mixes them with another set). Call after ``can_start``."""
        tag = version if version is not None else -step
        ref = self.evaluator.evaluate_weights.remote(tag, weights, self.cfg.data.test_files,
                                                     self.cfg.eval.num_questions)
        self.pending = Pending(step, version, ref, self.clock())

    def poll(self, wait_s: float = 0.0) -> dict | None:
        """The running evaluation's record once it is done (``eval.jsonl``'s fields plus ``beside``), waiting up to
        ``wait_s``; None while it runs, when none runs, or when it failed (said once, and no more start)."""
        p = self.pending
        if p is None:
            return None
        ready, _ = ray.wait([p.ref], timeout=max(0.0, wait_s))
        if not ready:
            if self.clock() - p.started > self.limit_s:
                self._fail(f"it did not finish within {self.limit_s:.0f} s")
            return None
        try:
            scores = ray.get(p.ref, timeout=REPORT_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            self._fail(cause(e))
            return None
        self.pending = None
        self.finished += 1
        seconds = scores.pop("seconds")  # the evaluation's own time, on the evaluator
        return {"when": f"step {p.step}", "step": p.step, "version": p.version, "beside": True,
                "seconds": seconds, **scores}

    def finish(self, stopping: Callable[[], bool] = lambda: False) -> dict | None:
        """At the end of training: the running evaluation's record, waiting for it within its time limit, in
        one-second slices; None at once when ``stopping()`` says the run is being stopped."""
        while self.pending is not None and not stopping():
            rec = self.poll(wait_s=1.0)
            if rec is not None:
                return rec
        return None

    def _fail(self, why: str) -> None:
        step = self.pending.step if self.pending else None
        self.pending = None
        self.failed = why
        try:
            ray.kill(self.evaluator, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.say(f"[warn] the evaluator failed during the evaluation of step {step} ({why}); no more evaluations "
                 "beside training in this run (the end evaluation runs on rollout actor 0)")

    def summary(self) -> dict:
        return {"evals_beside": self.finished, "evals_skipped": self.skipped, "evaluator_failed": self.failed}
