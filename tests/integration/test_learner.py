"""The plain ``Learner`` on real DeepSpeed (CPU, gloo, one rank) with the tiny Qwen2 model.

Log-probs are checked against an independent transformers computation: the sampling policy's log-probs are computed
here with ``log_softmax(logits / T)`` and recorded as ``behavior_logprobs``, and parameters published by the learner
are loaded into a fresh transformers model to measure what the steps did.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from async_agent_rl.batch import TrainBatch, pack_batch
from async_agent_rl.config import build_config
from async_agent_rl.records import EpisodeMeta, Trajectory, TurnSpan
from learner.learner import Learner

pytestmark = pytest.mark.integration

PAD = 0


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def token_logprobs(model, ids: list[int], temperature: float = 1.0) -> list[float]:
    """log p(ids[t] | ids[:t]) under softmax(logits / T) for t = 1..n-1 (independent of the learner's code)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


def episode(model, prompt: list[int], turns: list[tuple[str, list[int]]], reward: float, group: str,
            version: int = 0, temperature: float = 1.0) -> Trajectory:
    """A trajectory whose behavior log-probs are the model's own (as if it sampled the model turns)."""
    response = [t for _, ids in turns for t in ids]
    lp = token_logprobs(model, prompt + response, temperature)[len(prompt) - 1:]
    mask, spans, pos = [], [], 0
    for kind, ids in turns:
        mask += [1 if kind == "model" else 0] * len(ids)
        spans.append(TurnSpan(kind, pos, pos + len(ids)))
        pos += len(ids)
    return Trajectory(
        prompt_ids=prompt, response_ids=response, loss_mask=mask,
        behavior_logprobs=[x if m else 0.0 for x, m in zip(lp, mask)],
        versions=[version if m else -1 for m in mask], turns=spans, reward=reward,
        meta=EpisodeMeta(group_id=group)).validate()


def two_groups(model, temperature: float = 1.0, versions=(0, 0, 0, 0)) -> TrainBatch:
    """Two prompts x two rollouts, one right and one wrong each; prompts of different lengths."""
    p1, p2 = [101, 102, 103, 104, 105], [201, 202, 203]
    rows = [
        (p1, [("model", [301, 302, 303]), ("observation", [401, 402]), ("model", [304, 305])], 1.0, "a"),
        (p1, [("model", [311, 312]), ("observation", [411, 412, 413]), ("model", [314])], 0.0, "a"),
        (p2, [("model", [321, 322, 323, 324]), ("observation", [421]), ("model", [325, 326])], 1.0, "b"),
        (p2, [("model", [331, 332]), ("observation", [431, 432]), ("model", [333, 334, 335])], 0.0, "b"),
    ]
    return pack_batch([episode(model, p, t, r, g, v, temperature) for (p, t, r, g), v in zip(rows, versions)], PAD)


def make_learner(model_dir, **sections) -> Learner:
    tree = {
        "model": {"path": str(model_dir)},
        "rollout": {"group_size": 2},
        "learner": {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2, "lr": 1e-3, "total_steps": 10},
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "decoupled_ppo"},
    }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return Learner(build_config(tree))


def sequence_logprob(model, state: dict, batch: TrainBatch, row: int, positions: list[int]) -> float:
    """Sum of log p(token) at ``positions`` of ``row`` under the published ``state`` loaded into ``model``."""
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    n = int(batch.seq_lengths[row])
    lp = token_logprobs(model, batch.input_ids[row, :n].tolist())
    return sum(lp[p - 1] for p in positions)


def model_positions(batch: TrainBatch, row: int) -> list[int]:
    return batch.loss_mask[row].nonzero().flatten().tolist()


def observation_positions(batch: TrainBatch, row: int) -> list[int]:
    response = torch.arange(batch.input_ids.shape[1]) >= batch.prompt_lengths[row]
    obs = response & (batch.attention_mask[row] > 0) & (batch.loss_mask[row] == 0)
    return obs.nonzero().flatten().tolist()


# ------------------------------------------------------------------------------------------------------- tests
def test_lr_schedule_and_gradient_clipping_reach_the_optimizer(tiny_model_dir, hf_model):
    """Warmup then linear decay, as ``lr_factor``; a clip norm of 1e-12 leaves Adam steps of ~lr * 1e-6 where an
    unclipped first step moves every trained weight by ~lr."""
    batch = two_groups(hf_model)
    learner = make_learner(tiny_model_dir, learner={"warmup_steps": 2, "total_steps": 4, "lr_schedule": "linear",
                                                    "grad_clip": 1e-12})
    before = learner.state_dict_for_publish()
    lrs = [learner.train_step(batch).lr for _ in range(4)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])
    assert learner.policy.engine.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    after = learner.state_dict_for_publish()
    assert max(float(abs(after[n] - before[n]).max()) for n in after) < 1e-6


def test_proximal_pass_reproduces_the_sampling_policy_and_staleness_is_measured(tiny_model_dir, hf_model):
    """Behavior log-probs from an independent forward at T=0.7: the learner's proximal recompute (shift by one,
    prompt-length window, temperature) must agree, so every behavior weight is 1."""
    batch = two_groups(hf_model, temperature=0.7, versions=(0, 1, 1, 2))
    learner = make_learner(tiny_model_dir, rollout={"temperature": 0.7})
    learner.bump_version(), learner.bump_version()
    m = learner.train_step(batch)
    assert m.iw_mean == pytest.approx(1.0, abs=1e-4)
    assert m.iw_max == pytest.approx(1.0, abs=1e-4)
    assert m.behavior_kl < 1e-6 and m.iw_capped_frac == 0.0
    assert (m.staleness_mean, m.staleness_max) == (pytest.approx(1.0), 2.0)  # 2 - (0, 1, 1, 2)
    assert m.loss_tokens == float(batch.loss_mask.sum())
    assert (m.step, m.version) == (1.0, 2.0)


@pytest.mark.parametrize("zero_stage,dtype", [(0, "float32"), (3, "bfloat16")])
def test_steps_raise_the_rewarded_responses(tiny_model_dir, hf_model, zero_stage, dtype):
    """A few steps on a fixed batch: the loss falls, right answers gain log-prob, wrong ones lose it. The stage-3
    bf16 run also carries a KL to a reference model (zero before the first update, positive after)."""
    batch = two_groups(hf_model)
    kl = {"kl_coef": 0.01} if zero_stage == 3 else {}
    learner = make_learner(tiny_model_dir, learner={"zero_stage": zero_stage, "dtype": dtype,
                                                    "use_reference_model": bool(kl)}, algorithm=kl)
    engine = learner.policy.engine
    assert engine.zero_optimization_stage() == zero_stage
    assert isinstance(engine.basic_optimizer, torch.optim.AdamW)  # a torch optimizer: no op to compile
    assert next(engine.module.parameters()).dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    before = learner.state_dict_for_publish()
    metrics = [learner.train_step(batch) for _ in range(5)]
    after = learner.state_dict_for_publish()

    losses = [m.policy_loss for m in metrics]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(math.isfinite(m.grad_norm) and m.grad_norm > 0 for m in metrics)
    for row, sign in ((0, 1), (1, -1), (2, 1), (3, -1)):
        positions = model_positions(batch, row)
        change = (sequence_logprob(hf_model, after, batch, row, positions)
                  - sequence_logprob(hf_model, before, batch, row, positions))
        assert sign * change > 0.1, (row, change)

    names = [n for n, _ in hf_model.named_parameters()]
    assert list(after) == names
    assert all(a.dtype.name == "float32" and a.flags.c_contiguous for a in after.values())
    assert all(after[n].shape == tuple(p.shape) for n, p in hf_model.named_parameters())
    if kl:
        assert metrics[0].kl < 1e-6 < metrics[-1].kl


def test_mask_observations_switch_decides_whether_the_loss_trains_on_observations(tiny_model_dir, hf_model):
    """One rewarded episode (a group of one keeps its raw score, so every loss token has advantage 1). With
    observations masked the steps leave the observation tokens' log-probs nearly alone; unmasked (Search-R1's
    ablation) the loss sees them and pushes them up like the model's own tokens."""
    prompt = [101, 102, 103]
    turns = [("model", [301, 302, 303]), ("observation", [401, 402, 403, 404]), ("model", [304, 305])]
    batch = pack_batch([episode(hf_model, prompt, turns, 1.0, "")], PAD)
    obs = observation_positions(batch, 0)
    rise = {}
    for masked in (True, False):
        learner = make_learner(tiny_model_dir, rollout={"group_size": 1},
                               learner={"batch_size": 1, "mini_batch_size": 1, "micro_batch_size": 1},
                               algorithm={"mask_observations": masked})
        before = learner.state_dict_for_publish()
        metrics = [learner.train_step(batch) for _ in range(3)]
        after = learner.state_dict_for_publish()
        rise[masked] = (sequence_logprob(hf_model, after, batch, 0, obs)
                        - sequence_logprob(hf_model, before, batch, 0, obs))
        assert metrics[0].loss_tokens == 5 + (0 if masked else len(obs))
    assert rise[False] > 1.0 and abs(rise[True]) < 0.25 * rise[False], rise


def test_frozen_parameters_stay_fixed_and_the_others_train(tiny_model_dir, hf_model):
    """``learner.frozen_parameters=[self_attn]``: three steps move the MLPs and leave every attention projection
    bit for bit as it was (what is published is what the engine gets); a pattern that finds no parameter, or
    patterns that find them all, are one input error at the learner's start, not a run that trains nothing."""
    from async_agent_rl.errors import InputError

    learner = make_learner(tiny_model_dir, learner={"frozen_parameters": ["self_attn"]})
    before = learner.state_dict_for_publish()
    for _ in range(3):
        learner.train_step(two_groups(hf_model))
    after = learner.state_dict_for_publish()
    attention = [k for k in before if "self_attn" in k]
    mlp = [k for k in before if ".mlp." in k]
    assert attention and mlp
    assert all(np.array_equal(before[k], after[k]) for k in attention)
    assert all(not np.array_equal(before[k], after[k]) for k in mlp)
    with pytest.raises(InputError, match=r"learner.frozen_parameters: 'self_atn' finds no parameter"):
        make_learner(tiny_model_dir, learner={"frozen_parameters": ["self_atn"]})
    with pytest.raises(InputError, match=r"find every parameter of the policy: nothing would train"):
        make_learner(tiny_model_dir, learner={"frozen_parameters": ["."]})
    # the rest, with the embeddings fixed by learner.freeze_embeddings: nothing would train either
    with pytest.raises(InputError, match=r"find every parameter of the policy: nothing would train"):
        make_learner(tiny_model_dir, learner={"freeze_embeddings": True, "frozen_parameters": [r"^model\.(layers|norm)"]})


def test_gae_critic_learns_and_plain_ppo_skips_the_proximal_pass(tiny_model_dir, hf_model):
    batch = two_groups(hf_model)
    learner = make_learner(tiny_model_dir, learner={"critic_lr": 1e-3},
                           algorithm={"advantage_estimator": "gae", "policy_loss": "ppo", "lam": 0.95})
    assert not learner.needs_proximal
    metrics = [learner.train_step(batch) for _ in range(4)]
    assert metrics[-1].value_loss < metrics[0].value_loss
    assert all(m.critic_grad_norm > 0 for m in metrics)
    assert metrics[0].iw_mean is None  # behavior-anchored: no proximal policy, no behavior weight


def test_a_diverged_step_stops_training_and_nothing_non_finite_is_published_or_saved(tiny_model_dir, hf_model,
                                                                                    tmp_path):
    """A step leaves a non-finite weight behind (the config refuses a non-finite lr, so the divergence is made by
    hand after a real step): publishing or saving it is refused, and the next step's loss is caught."""
    import torch

    from learner.checkpoint import save_checkpoint
    from learner.learner import NonFiniteError

    batch = two_groups(hf_model)
    learner = make_learner(tiny_model_dir)
    learner.train_step(batch)
    with torch.no_grad():
        next(learner.policy.engine.module.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteError, match="learner step 1: non-finite parameters"):
        learner.state_dict_for_publish()
    with pytest.raises(NonFiniteError, match="learner step 1: non-finite parameters"):
        save_checkpoint(learner, tmp_path / "final")
    assert not (tmp_path / "final" / "policy").exists()
    with pytest.raises(NonFiniteError, match="learner step 2: non-finite loss or gradient norm: policy_loss"):
        learner.train_step(batch)


def test_a_batch_padded_with_filler_rows_makes_the_update_of_its_real_rows(tiny_model_dir, hf_model):
    """A batch of whole groups one of which lost a member has fewer trajectories than ``learner.batch_size``; the
    buffer pads it with filler rows (no loss token, a group of their own). The step must equal a step on the real
    rows alone: same weights after it, same reward, the filler counted."""
    full = two_groups(hf_model)
    real = [
        Trajectory(prompt_ids=full.input_ids[i, :int(full.prompt_lengths[i])].tolist(),
                   response_ids=full.input_ids[i, int(full.prompt_lengths[i]):int(full.seq_lengths[i])].tolist(),
                   loss_mask=full.loss_mask[i, int(full.prompt_lengths[i]):int(full.seq_lengths[i])].int().tolist(),
                   behavior_logprobs=full.behavior_logprobs[i, int(full.prompt_lengths[i]):int(full.seq_lengths[i])].tolist(),
                   versions=full.versions[i, int(full.prompt_lengths[i]):int(full.seq_lengths[i])].tolist(),
                   turns=[TurnSpan("model", 0, 1)], reward=float(full.rewards[i]), meta=full.metas[i])
        for i in range(3)  # group "a" whole, group "b" lost its second member
    ]
    padded = pack_batch(real, PAD, rows=4)
    assert (padded.batch_size, padded.real_rows) == (4, 3)
    learner = make_learner(tiny_model_dir)
    reference = make_learner(tiny_model_dir, rollout={"group_size": 1},
                             learner={"batch_size": 3, "mini_batch_size": 3, "micro_batch_size": 1})
    m = learner.train_step(padded)
    r = reference.train_step(pack_batch(real, PAD))
    assert m.extra["filler_rows"] == 1.0 and m.reward_mean == pytest.approx(r.reward_mean) == pytest.approx(2 / 3)
    assert m.loss_tokens == r.loss_tokens
    assert m.policy_loss == pytest.approx(r.policy_loss, abs=1e-6)
    after, ref_after = learner.state_dict_for_publish(), reference.state_dict_for_publish()
    # Adam moves each trained weight by ~lr = 1e-3; the two updates agree to a few hundredths of that (Adam divides
    # by the root of tiny second moments, which amplifies float reassociation between 2 and 3 micro-batches)
    before = make_learner(tiny_model_dir).state_dict_for_publish()
    assert max(float(abs(after[n] - before[n]).max()) for n in after) > 5e-4
    assert max(float(abs(after[n] - ref_after[n]).max()) for n in after) < 5e-5


def test_the_learners_process_group_listens_on_loopback_only(tiny_model_dir):
    """Rank 0's rendezvous store binds the loopback MASTER_ADDR. Before, DeepSpeed's ``env://`` rendezvous made a
    store that listened on every interface, unauthenticated, for the whole run."""
    import ipaddress
    import os

    import psutil

    make_learner(tiny_model_dir)

    def loopback(ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)

    mine = [c.laddr for c in psutil.net_connections(kind="inet") if c.pid == os.getpid()
            and c.status == psutil.CONN_LISTEN]
    assert int(os.environ["MASTER_PORT"]) in {a.port for a in mine}, mine  # the store is this process's
    assert all(loopback(a.ip) for a in mine), f"listening beyond loopback: {mine}"


def test_one_rank_skips_deepspeeds_gradient_all_reduce_and_updates_the_same(tiny_model_dir, hf_model):
    """With one rank there is nothing to average: the learner turns off DeepSpeed's gradient all-reduce (a copy of
    every gradient into a fresh buffer and back at each update, 11% of a 100M model's step). Two micro-batches per
    update (accumulation), and the update equals the one the all-reduce path makes."""
    batch = two_groups(hf_model)
    off = make_learner(tiny_model_dir)
    assert off.policy.engine.enable_backward_allreduce is False
    on = make_learner(tiny_model_dir)
    on.policy.engine.enable_backward_allreduce = True  # DeepSpeed's own path, as before the change
    a, b = off.train_step(batch), on.train_step(batch)
    assert a.policy_loss == pytest.approx(b.policy_loss, abs=1e-7)
    pa, pb = off.state_dict_for_publish(), on.state_dict_for_publish()
    assert max(float(abs(pa[n] - pb[n]).max()) for n in pa) < 1e-6
