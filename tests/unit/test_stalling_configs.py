"""Nothing stalls in silence: configs that were accepted and then stalled or misbehaved are refused when loaded, each in
one ``error:`` report naming the keys (exit 2); a YAML key given twice is an error naming the key and line (YAML keeps
the last one silently); ``run.name`` cannot leave ``run.output_dir``; a retrieval server bound beyond loopback says so
when it starts. The shipped configs still load (tests/unit/test_config.py loads both)."""

from __future__ import annotations

import json
import random

import pytest

import retriever.cli
from async_agent_rl.config import ConfigError, load_config
from buffer.replay_buffer import ReplayBuffer
from driver.cli import main
from retriever.server import exposure_warning
from tests.helpers import Clock, traj

pytestmark = pytest.mark.unit

REFUSED = [
    # defaults: model.max_model_len 2048, data.max_prompt_length 512, rollout.max_response_length 512,
    # rollout.max_obs_length 256, learner.batch_size 40, rollout.group_size 5
    # a batch of 40 trajectories of up to 512 + 512 tokens each needs 40960 tokens of buffer
    (["buffer.capacity_tokens=40959"],
     "buffer.capacity_tokens (40959) must be at least learner.batch_size x (data.max_prompt_length + "
     "rollout.max_response_length) (40 x (512 + 512) = 40960)"),
    # was accepted: the buffer holds one of the eight groups of a batch, pushes were retried for ever
    (["buffer.capacity_tokens=2048", "buffer.capacity_trajectories=40"],
     "buffer.capacity_tokens (2048) must be at least learner.batch_size x"),
    (["buffer.capacity_tokens=40960", "data.max_prompt_length=600"],
     "(40 x (600 + 512) = 44480)"),
    (["buffer.capacity_trajectories=39"], "buffer.capacity_trajectories (39) must be at least learner.batch_size (40)"),
    (["rollout.max_response_length=1537"],
     "rollout.max_response_length (1537) must be at most model.max_model_len - data.max_prompt_length "
     "(2048 - 512 = 1536)"),
    (["model.max_model_len=1000"], "rollout.max_response_length (512) must be at most model.max_model_len"),
    (["rollout.max_obs_length=513"], "rollout.max_obs_length (513) must be at most rollout.max_response_length (512)"),
    (["learner.batch_size=42", "learner.mini_batch_size=42", "learner.micro_batch_size=42"],
     "learner.batch_size (42) must be a multiple of rollout.group_size (5)"),  # was already refused
    (["run.name=../../elsewhere"], "run.name: Value error, must be one plain folder name inside run.output_dir"),
    (["run.name=/tmp/abs"], "run.name: Value error, must be one plain folder name"),
    (["run.name=a/b"], "run.name: Value error, must be one plain folder name"),
    (["run.name=a\\b"], "run.name: Value error, must be one plain folder name"),
    (["run.name=.."], "run.name: Value error, must be one plain folder name"),
    (["run.name=''"], "run.name: Value error, must be one plain folder name"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_a_config_that_would_stall_or_misbehave_is_refused_in_one_error(overrides, message, capsys):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    code = main(["config", "show", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.splitlines()[0]], err
    assert message in err


ACCEPTED = [
    ["buffer.capacity_tokens=40960", "buffer.capacity_trajectories=40"],  # exactly a batch of the longest
    ["rollout.max_response_length=1536", "rollout.max_obs_length=1536"],  # exactly what the prompt leaves
    ["run.name=seed0-rl"], ["run.name=a.b"], ["run.name=..x"],
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_the_edges_still_load(overrides):
    load_config(None, overrides)


def test_the_token_rule_is_the_buffers_own():
    """The edge of the rule is the buffer's: at ``capacity_tokens = batch_size x (max_prompt_length +
    max_response_length)`` a batch of the longest trajectories forms; one token less and it never does (the last
    member waits for room only a batch would free). The config that used to load (2048 tokens, 40 trajectories)
    holds one group of 300-token trajectories of the eight a batch needs."""
    config = load_config(None, ["buffer.capacity_tokens=40960", "buffer.capacity_trajectories=40"])
    group, batch, longest = config.rollout.group_size, config.learner.batch_size, config.max_trajectory_tokens
    assert (group, batch, longest) == (5, 40, 1024)

    def fill(capacity_tokens: int, tokens: int) -> tuple[int, list | None]:
        buffer = ReplayBuffer(config.buffer.model_copy(update={"capacity_tokens": capacity_tokens}), group,
                              max_trajectory_tokens=longest, clock=Clock())
        stored = 0
        for g in range(batch // group):
            for m in range(group):
                stored += buffer.push([traj(f"g{g}", m, tokens=tokens)]).accepted
        return stored, buffer.sample_wire(batch, 0)

    stored, sampled = fill(40960, longest)
    assert stored == batch and sampled is not None and len(sampled) == batch
    stored, sampled = fill(40959, longest)
    assert stored < batch and sampled is None
    stored, sampled = fill(2048, 300)
    assert stored == group and sampled is None


def test_token_promises_never_let_groups_in_that_cannot_all_complete():
    """The token twin of ``test_staleness.py::test_a_full_buffer_never_stalls_an_actors_pushes``. Defaults (groups of
    5, batch 40: 8 groups, the longest trajectory 1024 tokens, eta 2) with ``capacity_tokens`` at the least allowed,
    40 x 1024: admission lets 24 groups run. Every group's first member is short (3 tokens) and finishes first.
    When a pending group was promised its arrived members' mean length (4 x 3 more tokens), all 24 were taken, their
    longest members (1024 tokens) filled the buffer before any group completed and every push was refused for ever,
    in any order. Each missing member is now promised the longest trajectory (``Config.max_trajectory_tokens``): 8
    groups are let in, they complete, a batch forms, and all 24 groups are trained on, in this order and in shuffled
    ones."""
    from buffer.actor import BufferActor

    config = load_config(None, ["buffer.capacity_tokens=40960"])
    group, batch, longest = config.rollout.group_size, config.learner.batch_size, config.max_trajectory_tokens
    groups = (config.buffer.max_staleness + 1) * batch // group
    assert (group, batch, longest, groups) == (5, 40, 1024, 24)
    for seed in (None, 0, 1, 2):
        buffer = BufferActor(config.buffer, group_size=group, consumed_per_version=batch,
                             max_concurrent=group * groups, batch_size=batch, max_trajectory_tokens=longest)
        assert all(buffer.try_start(group, 0, f"g{g}", "a0") == group for g in range(groups))
        outbox = [traj(f"g{g}", 0, tokens=3) for g in range(groups)]  # the short members finish first
        outbox += [traj(f"g{g}", m, tokens=longest) for m in range(1, group) for g in range(groups)]
        if seed is not None:
            random.Random(seed).shuffle(outbox)
        version = 0
        for _ in range(3 * groups):  # everything refused is sent again, in front of nothing new
            outbox = buffer.push_many(outbox).rest(outbox)
            version += buffer.sample(batch, version) is not None
            if version == groups * group // batch:
                break
        stats = buffer.stats()
        assert version == 3 and not outbox, (f"order {seed}: {len(outbox)} refused for ever, "
                                             f"{stats.ready_groups} ready, {stats.pending_groups} pending")
        assert stats.sampled == groups * group and stats.tokens <= config.buffer.capacity_tokens


@pytest.mark.parametrize("text, key, line, first", [
    ("learner:\n  lr: 1.0e-5\n  total_steps: 3\n  lr: 2.0e-5\n", "lr", 4, 2),
    ("run:\n  name: a\nrun:\n  device: cpu\n", "run", 3, 1),
    ("rollout: {group_size: 2, group_size: 4}\n", "group_size", 1, 1),
])  # fmt: skip
def test_a_key_given_twice_in_a_config_file_is_an_error_naming_it(tmp_path, capsys, text, key, line, first):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    code = main(["config", "show", "--config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"error: config file {path}: line {line}: duplicate key {key!r} (first on line {first}; "
                           "YAML would keep the last one silently)")


def test_a_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("learner: &base\n  lr: 1.0e-5\nsft:\n  <<: *base\n  lr: 1.0e-3\n")
    assert load_config(path).sft.lr == 1e-3


def test_a_retrieval_server_beyond_loopback_warns_when_it_starts(tmp_path, monkeypatch, capsys):
    """``retriever serve --host``: a warning line on stderr naming the address (serving itself is stubbed: what is
    tested is the command's start; the warning text is the one ``train`` prints for ``retriever.host``)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": '"Alpha"\nAlpha is a city.'}) + "\n")
    served = []

    async def serve_until_signalled(backend, config, announce="", parent_pid=None):
        served.append(config.host)

    monkeypatch.setattr(retriever.cli, "serve_until_signalled", serve_until_signalled)
    for host in ("0.0.0.0", "127.0.0.1", "::1", "localhost"):
        assert main(["retriever", "serve", "--corpus", str(corpus), "--host", host, "--port", "0"]) == 0
        err = capsys.readouterr().err
        warnings = [line for line in err.splitlines() if line.startswith("warning:")]
        if host == "0.0.0.0":
            assert warnings == [f"warning: {exposure_warning(host)}"] and "listens on 0.0.0.0" in warnings[0]
        else:
            assert warnings == [], err
    assert served == ["0.0.0.0", "127.0.0.1", "::1", "localhost"]
    assert exposure_warning("192.0.2.7") and exposure_warning("::") and not exposure_warning("127.0.0.2")
