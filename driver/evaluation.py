"""Evaluations beside training (``eval.beside``): the RL loop does not wait for them.

``Evaluations`` says when the held-out evaluations run and where: at the start of a fresh run (``eval.at_start``)
and at the end (``eval.at_end``) on rollout actor 0, waited for; every ``eval.every_steps`` learner steps (the last
step's is the end's) on rollout actor 0 while the loop waits, or beside training with ``eval.beside``.

An evaluation due every ``eval.every_steps`` learner steps normally runs on rollout actor 0 while the loop waits. Beside training it runs on an engine of its own, the *evaluator* (a rollout actor asked for
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
from async_agent_rl.waits import bounded
from driver.limits import REPORT_TIMEOUT_S, cause, eval_limit_s, phase_limit, test_questions, wait_phase
from driver.stops import StopRequests


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
        ready, _ = bounded(ray.wait, [p.ref], timeout_s=max(0.0, wait_s), what="the evaluator")
        if not ready:
            if self.clock() - p.started > self.limit_s:
                self._fail(f"it did not finish within {self.limit_s:.0f} s")
            return None
        try:
            scores = bounded(ray.get, p.ref, timeout_s=REPORT_TIMEOUT_S, what="the evaluator")
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


class Evaluations:
    """When the held-out evaluations run and where (see the module docstring). ``record(rec, step)``: what records
    a finished evaluation at the learner's ``step`` (``driver.records.Records.eval``); ``beside``: the evaluations
    beside training, once the evaluator has started (None without ``eval.beside``); ``stops``: the run's
    ``StopRequests`` (an evaluation waited for ends at once on a stop request)."""

    def __init__(self, cfg: Config, record: Callable[[dict | None, int], None], stops: Any = None):
        self.cfg, self.record, self.stops = cfg, record, stops
        self.beside: EvaluationBeside | None = None

    def waited(self, actor: Any, when: str, step: int, version: int) -> dict:
        """An evaluation on rollout actor ``actor`` (actor 0), waited for within its phase limit (``phase_limit``),
        and recorded; a stop request ends the wait (``StopRequested``), except at the end of the run."""
        cfg, t = self.cfg, time.monotonic()
        limit, said = phase_limit(cfg, "evaluation", cfg.eval.num_questions or test_questions(cfg.data.test_files))
        # the end's runs after the loop, where a stop has nothing left to cut short: it keeps its whole limit
        scores = wait_phase([actor.evaluate.remote(cfg.data.test_files, cfg.eval.num_questions)], limit,
                            f"rollout actor 0 (the evaluation at {when})", said, self.stops, stop_limit=limit,
                            on_stop="finish" if when == "end" else "abandon")[0]
        rec = {"when": when, "step": step, "version": version, "seconds": time.monotonic() - t, **scores}
        self.record(rec, step)
        return rec

    def after_step(self, step: int, versions: Any, actor: Any, stops: StopRequests) -> None:
        """After learner step ``step``: the evaluation due at it, if any (beside training, or on rollout ``actor``
        0 while the loop waits, a stop request honoured after it); then the one beside training, once it is done."""
        every = self.cfg.eval.every_steps
        if every and step % every == 0 and step < self.cfg.learner.total_steps:
            if self.beside is not None:
                self.evaluate_beside(step, versions)
            else:
                self.waited(actor, f"step {step}", step, versions.version)
                stops.check()
        if self.beside is not None:
            self.record(self.beside.poll(), step)

    def evaluate_beside(self, step: int, versions: Any) -> None:
        """The evaluation of ``step`` on the evaluator, not waited for: the learner's weights of this step (on the
        object-store path, the ones just published when this step published), tagged with their policy version when
        they were published as one (``versions``: the run's ``PolicyVersions``)."""
        if not self.beside.can_start(step):  # skipped before any weights are taken
            return
        published = versions.published_step == step
        weights = versions.weights_ref if published and versions.weights_ref is not None else \
            versions.learner.state_dict_ref()
        self.beside.start(step, versions.version if published else None, weights)

    def finish(self, step: int, stops: StopRequests) -> None:
        """At the end of training: the evaluation still running beside it, waited for and recorded (a stop request
        ends the wait, and is honoured)."""
        if self.beside is not None:
            self.record(self.beside.finish(stopping=lambda: stops.signal is not None), step)
            stops.check()

    def summary(self) -> dict | None:
        return self.beside.summary() if self.beside is not None else None
