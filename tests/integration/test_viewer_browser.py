"""The run viewer in a real headless browser (Debian's ``chromium`` driven by Selenium through ``chromedriver``)
during a REAL training (``async-agent-rl train`` as a subprocess: Ray, retriever, buffer, DeepSpeed learner, a vLLM
rollout actor), started from the committed warm start (``tests/data/learns_warm_start``) so that episodes search.

The page is opened while the run trains: a learning curve must get points from the run's own ``metrics.jsonl``
before the run ends, an episode of the browser must open and show its turns (prompt, model turns with per-token
policy versions, the search query and the retrieved information when it searched), the kind filter must filter,
and once the run has ended the page must say so and show every step. A screenshot is taken
(``AAR_VIEWER_SCREENSHOT=docs/viewer.png`` keeps it there too).

Where the episodes come from: once the training loop (``driver/``) records the sample each step
(``EpisodeSample.record``), the run keeps its own. Until then (``HOOKED`` False) the test does what that one call would, from a real
``async-agent-rl rollout`` of the same warm start: each time the run writes a step's metrics line, that step gets
four of the rollout's episodes through ``EpisodeSample`` (the class the loop will call), so the browser still reads
episodes written while a real training runs.

Needs ``chromium`` and ``chromedriver`` (``scripts/install_chromium.sh``; ``scripts/test.sh`` runs it) and
``selenium`` (the dev extra); skips without them. About 4-5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import cli, end_tree, plain_env, world_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
WARM_START = REPO / "tests" / "data" / "learns_warm_start"
STEPS = 6
RUN_TIMEOUT_S = 600
# the training loop keeps the sample itself once a driver module makes the call (driver/view.py names no class)
HOOKED = any("EpisodeSample(" in p.read_text() for p in (REPO / "driver").rglob("*.py"))
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")

needs_browser = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER) or __import__("importlib").util.find_spec("selenium") is None,
    reason="needs chromium and chromedriver (scripts/install_chromium.sh, as root) and selenium (the dev extra)",
)






def browser():
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch anything: both binaries are given
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tempfile.mkdtemp(prefix='aar_chromium_')}", "--window-size=1400,2100"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def wait_until(what: str, fn, timeout_s: float, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(poll_s)
    pytest.fail(f"not within {timeout_s} s: {what}")


class Feeder(threading.Thread):
    """What the training loop's one call will do, until it does: each new step of ``metrics.jsonl`` gets ``per_step``
    of ``episodes`` (those that searched first) through ``EpisodeSample.record``."""

    def __init__(self, run_dir: Path, episodes: list, per_step: int = 4):
        super().__init__(daemon=True)
        from monitoring.episode_sample import EpisodeSample

        self.run_dir, self.per_step = run_dir, per_step
        self.episodes = sorted(episodes, key=lambda t: -t.meta.num_searches)
        self.sample = EpisodeSample(run_dir, str(WARM_START), per_step=per_step)
        self.done = threading.Event()
        self.steps: list[int] = []

    def run(self) -> None:
        while not self.done.is_set():
            path = self.run_dir / "metrics.jsonl"
            lines = path.read_text().splitlines() if path.is_file() else []
            for line in lines:
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError):
                    continue
                if step not in self.steps:
                    k = len(self.steps) * self.per_step % len(self.episodes)
                    chunk = (self.episodes + self.episodes)[k : k + self.per_step]
                    self.sample.record(step, chunk)
                    self.steps.append(step)
            time.sleep(0.3)


@needs_browser
def test_the_viewer_in_chromium_during_a_real_training(tmp_path, request, world_dir):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    env = {**plain_env(), "PYTHONUNBUFFERED": "1"}
    base = ["--config", "configs/quickstart.yaml", *world_overrides(world_dir, WARM_START)]
    episodes = []
    if not HOOKED:  # a real rollout of the same policy: the episodes the feeder writes during the training
        out = tmp_path / "rollout.jsonl"
        r = subprocess.run([*cli(), "rollout", *base, "--num-episodes", "24", "--out", str(out)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        from actors.stack import read_episodes

        episodes = read_episodes(out)
        assert any(t.meta.num_searches for t in episodes), "the warm start's sampled policy never searched"

    run_dir = tmp_path / "runs" / "viewed"
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        train = subprocess.Popen(
            [*cli(), "train", *base, "run.name=viewed", f"run.output_dir={tmp_path / 'runs'}", "sft.enabled=false",
             f"learner.total_steps={STEPS}", "learner.batch_size=16", "learner.mini_batch_size=16",
             "learner.micro_batch_size=8", "eval.num_questions=32", "monitoring.enabled=false"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    request.addfinalizer(lambda: end_tree(train))

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    wait_until("the run folder", lambda: (run_dir / "config.yaml").is_file() or train.poll() is not None, 120)
    assert train.poll() is None, log_tail()
    feeder = None
    if not HOOKED:
        feeder = Feeder(run_dir, episodes)
        feeder.start()
        request.addfinalizer(feeder.done.set)
    viewer = subprocess.Popen([*cli(), "view", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    request.addfinalizer(lambda: end_tree(viewer))
    line = viewer.stdout.readline()
    assert " on http://127.0.0.1:" in line, line + viewer.stderr.read()
    url = line.split(" on ")[1].split()[0]

    driver = browser()
    request.addfinalizer(driver.quit)
    driver.get(url + "?refresh_ms=1000")
    wait_until("the run's name in the header", lambda: driver.find_element(By.ID, "run-name").text == "viewed", 30)

    def points(chart: str) -> int:
        return int(driver.execute_script(
            f"const s = document.querySelector('#{chart} svg'); return s ? Number(s.getAttribute('data-points')) : 0"))

    # --- during the training: a curve gets points from the run's metrics.jsonl, episodes show up in the browser
    wait_until("a point on the reward curve", lambda: points("chart-reward") > 0 or train.poll() is not None,
               RUN_TIMEOUT_S)
    assert train.poll() is None, "the run ended before the page showed a point:\n" + log_tail()
    assert driver.find_elements(By.CSS_SELECTOR, "#chart-reward circle.pt")
    rows = wait_until("an episode in the list",
                      lambda: driver.find_elements(By.CSS_SELECTOR, "#episode-list tbody tr"), 120)
    searched = [r for r in rows if int(r.find_elements(By.TAG_NAME, "td")[3].text) > 0]
    (searched or rows)[0].click()
    turns = wait_until("the episode's turns",
                       lambda: driver.find_elements(By.CSS_SELECTOR, "#episode-detail .turn"), 30)
    kinds = [t.get_attribute("data-kind") for t in turns]
    assert kinds[0] == "prompt" and "model" in kinds, kinds
    versions = driver.find_elements(By.CSS_SELECTOR, "#episode-detail .turn.model span.run")
    assert versions and all(v.get_attribute("title").startswith("policy version ") for v in versions)
    if searched or not HOOKED:
        assert "search" in kinds and "information" in kinds, kinds
        info = driver.find_element(By.CSS_SELECTOR, "#episode-detail .turn.information")
        assert "masked" in info.get_attribute("class") and "<information>" in info.text
        query = driver.find_element(By.CSS_SELECTOR, "#episode-detail .turn.search pre").text
        assert query.strip(), "an empty search query shown"
    assert driver.find_element(By.CSS_SELECTOR, "#episode-detail .ep-head").text.startswith("step ")

    # the kind filter keeps only that kind
    kind_select = Select(driver.find_element(By.ID, "f-kind"))
    wait_until("a question kind to filter on", lambda: len(kind_select.options) > 1, 30)
    kind = kind_select.options[1].get_attribute("value")
    kind_select.select_by_value(kind)
    wait_until(f"only {kind} episodes listed", lambda: {
        r.find_elements(By.TAG_NAME, "td")[1].text for r in driver.find_elements(By.CSS_SELECTOR, "#episode-list tbody tr")
    } == {kind}, 30)
    kind_select.select_by_value("")

    # --- after the run: the page says so and has every step
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while train.poll() is None and time.monotonic() < deadline:
        time.sleep(1.0)
    assert train.poll() == 0, f"training exited with {train.poll()}:\n{log_tail()}"
    wait_until("the page to say the run finished",
               lambda: "finished" in driver.find_element(By.ID, "run-state").text, 30)
    wait_until(f"{STEPS} points of batch reward", lambda: len(driver.find_elements(
        By.CSS_SELECTOR, "#chart-reward g.series[data-name='batch reward'] circle.pt")) == STEPS, 30)
    wait_until("held-out exact match at the start and the end", lambda: len(driver.find_elements(
        By.CSS_SELECTOR, "#chart-reward g.series[data-name='held-out exact match (greedy)'] circle.pt")) == 2, 30)
    if feeder is not None:
        feeder.done.set()
        feeder.join(timeout=10)
        assert feeder.steps == list(range(1, STEPS + 1)) and feeder.sample.failures == 0
    steps_kept = sorted(int(p.name[5:11]) for p in (run_dir / "episodes").glob("step_*.jsonl"))
    assert steps_kept == list(range(1, STEPS + 1))
    # the episode opened again at the end, for the screenshot
    rows = driver.find_elements(By.CSS_SELECTOR, "#episode-list tbody tr")
    searched = [r for r in rows if int(r.find_elements(By.TAG_NAME, "td")[3].text) > 0]
    (searched or rows)[0].click()
    wait_until("the episode's turns", lambda: driver.find_elements(By.CSS_SELECTOR, "#episode-detail .turn"), 30)
    time.sleep(1.5)
    shot = tmp_path / "viewer.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
    keep = os.environ.get("AAR_VIEWER_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors

    viewer.send_signal(signal.SIGTERM)
    assert viewer.wait(timeout=20) == 0
