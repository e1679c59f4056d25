"""The rollout on the REAL vLLM engine (CPU build) and a real retrieval server: token/mask alignment, behavior
log-probs against a transformers recomputation, per-token versions across an in-flight weight update."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engine import HFEngine, TurnRequest, VLLMEngine, WeightsError
from actors.search_client import SearchClient
from async_agent_rl.config import load_config
from async_agent_rl.data.corpus import read_corpus
from async_agent_rl.data.search_r1 import read_qa_parquet
from async_agent_rl.episode import EpisodeRunner
from async_agent_rl.episode_settings import EpisodeSettings
from retriever.backends import BM25Backend
from retriever.server import start_server_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

# float32 end to end; vLLM's CPU kernels and transformers' eager attention differ by rounding only
LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return load_config(None, [f"model.path={tiny_model_dir}", "model.max_model_len=1024", "rollout.max_turns=3",
                              "rollout.max_tokens_per_turn=32", "rollout.max_response_length=256",
                              "rollout.max_obs_length=96", "data.prompt_template=minimal"])


@pytest.fixture(scope="module")
def server(world_dir):
    srv = start_server_in_thread(BM25Backend.build(read_corpus(world_dir / "corpus.jsonl")))
    yield srv
    srv.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(cfg, tiny_model_dir):
    eng = await VLLMEngine.create(str(tiny_model_dir), cfg)
    yield eng
    await eng.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def questions(world_dir):
    return read_qa_parquet(world_dir / "train.parquet")[:12]


def recompute_logprobs(model, traj, temperature=1.0) -> np.ndarray:
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(traj.prompt_ids) - 1 :].numpy()


async def test_episodes_on_vllm_line_up_and_logprobs_match_transformers(engine, server, cfg, hf, questions):
    model, tok = hf
    async with SearchClient(server.url, cfg.retriever.client) as sc:
        runner = EpisodeRunner(engine, sc, tok, EpisodeSettings.from_config(cfg))
        trajs = await asyncio.gather(*(runner.run(q, group_id="g") for q in questions))
    for t in trajs:
        t.validate()  # mask agrees with turn kinds, arrays agree in length
        mask = np.array(t.loss_mask, dtype=bool)
        assert mask[-1], "episodes end on a model token"
        assert set(np.array(t.versions)[mask]) == {0} and set(np.array(t.versions)[~mask]) <= {-1}
        ref = recompute_logprobs(model, t)
        got = np.array(t.behavior_logprobs)
        assert np.max(np.abs(ref[mask] - got[mask])) < LOGPROB_TOL
        assert np.all(got[~mask] == 0.0)  # observation tokens carry no behavior log-prob
    assert sum(t.num_generated_tokens for t in trajs) > 0


def weights_of(model) -> tuple[dict, dict]:
    original = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    return original, {k: v * 1.5 + 0.01 for k, v in original.items()}


async def test_paused_update_labels_later_tokens_and_changes_generation(engine, hf):
    model, _ = hf
    original, perturbed = weights_of(model)
    req = TurnRequest(prompt_ids=[5, 6, 7, 8], max_tokens=300, temperature=0.0, stop=())
    reference = await engine.generate(req)
    v0 = engine.version

    task = asyncio.create_task(engine.generate(req))
    await asyncio.sleep(0.3)
    await engine.update_weights(v0 + 1, perturbed, mode="pause")
    out = await task
    versions = np.array(out.versions)
    switch = int(np.argmax(versions == v0 + 1))
    assert versions[0] == v0 and versions[-1] == v0 + 1, "tokens after the update carry the new version"
    assert np.all(versions[:switch] == v0) and np.all(versions[switch:] == v0 + 1)
    assert out.token_ids[:switch] == reference.token_ids[:switch]  # before the update: the old policy, exactly
    assert out.token_ids[switch:] != reference.token_ids[switch:]  # after: a different policy generates

    await engine.update_weights(v0 + 2, original, mode="pause")  # back to the old weights, paused reload
    again = await engine.generate(req)
    assert again.token_ids == reference.token_ids and set(again.versions) == {v0 + 2}


async def test_inflight_update_never_serves_old_weight_kv(engine, hf):
    """A request running across an in-flight update keeps its old-weight KV, so all its tokens are labelled with
    the version it started at; a NEW request with the same long prompt must not get that KV from the prefix cache:
    its log-probs are the new weights' own (transformers recomputation)."""
    model, _ = hf
    original, perturbed = weights_of(model)
    # sharper output distributions make the new weights' log-probs depend clearly on which KV they read
    perturbed = {k: v * 8 if "embed" in k or "lm_head" in k else v for k, v in perturbed.items()}
    prompt = [5 + i % 1500 for i in range(600)]  # long enough to fill many prefix-cache blocks
    v0 = engine.version
    await engine.generate(TurnRequest(prompt_ids=prompt, max_tokens=4, stop=()))  # the prompt's KV at v0
    running = asyncio.create_task(engine.generate(TurnRequest(prompt_ids=prompt, max_tokens=300, stop=())))
    await asyncio.sleep(0.3)
    await engine.update_weights(v0 + 1, perturbed, mode="inflight")
    fresh = await engine.generate(TurnRequest(prompt_ids=prompt, max_tokens=16, stop=()))
    old = await running
    new_model = copy.deepcopy(model)
    new_model.load_state_dict({k: torch.from_numpy(v) for k, v in perturbed.items()})
    ids = torch.tensor([prompt + fresh.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(new_model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    ref = lp[len(prompt) - 1 :].numpy()
    assert np.max(np.abs(ref - np.array(fresh.logprobs))) < 1e-3
    assert set(fresh.versions) == {v0 + 1}
    assert set(old.versions) == {v0}, "tokens that depend on old-weight KV keep the old version"

    await engine.update_weights(v0 + 2, original, mode="pause")


async def test_incomplete_or_misshaped_weights_are_refused_and_nothing_changes(engine, hf):
    model, _ = hf
    original, _ = weights_of(model)
    req = TurnRequest(prompt_ids=[5, 6, 7, 8], max_tokens=16, temperature=0.0, stop=())
    before, v = await engine.generate(req), engine.version
    doubled = {k: x * 2 for k, x in original.items()}
    missing = {k: x for k, x in doubled.items() if ".layers.1." not in k}
    misshaped = {**doubled, "model.norm.weight": doubled["model.norm.weight"][:-1]}
    for bad, problem in ((missing, "missing"), (misshaped, "shape")):
        with pytest.raises(WeightsError, match=problem):
            await engine.update_weights(v + 1, bad, mode="pause")
        assert engine.version == v
    after = await engine.generate(req)
    assert after.token_ids == before.token_ids and set(after.versions) == {v}


async def test_transformers_engine_runs_the_same_workflow(tiny_model_dir, server, cfg, questions):
    hf_engine = HFEngine.load(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with SearchClient(server.url, cfg.retriever.client) as sc:
        runner = EpisodeRunner(hf_engine, sc, tok, EpisodeSettings.from_config(cfg))
        t = await runner.run(questions[0], group_id="g", seed=1)
    t.validate()
    # its behavior log-probs are the model's own: a recomputation agrees
    model = hf_engine.model
    mask = np.array(t.loss_mask, dtype=bool)
    assert np.max(np.abs(recompute_logprobs(model, t)[mask] - np.array(t.behavior_logprobs)[mask])) < LOGPROB_TOL


async def test_a_one_token_stop_string_stops_in_the_engine_core_with_the_strings_outputs(engine, hf):
    """A stop string that is one token is also sent as a stop token id (the engine core ends the turn at the step
    that samples it, not after the front end's abort); the turn is what the string alone gives: the same tokens,
    text and stop reason, ending at the string's first occurrence."""
    from actors.engine import one_token_ids

    _, tok = hf
    free = await engine.generate(TurnRequest(prompt_ids=[9, 10, 11, 12], max_tokens=40, temperature=0.0, stop=()))
    # the first token of the greedy continuation whose text is one token and not in the text before it: the stop
    j, stop = next(((j, tok.decode([t])) for j, t in enumerate(free.token_ids)
                    if one_token_ids(tok, [tok.decode([t])]) == [t] and tok.decode([t])
                    and tok.decode([t]) not in tok.decode(free.token_ids[:j])), (None, None))
    assert j is not None, f"no usable stop token in {free.token_ids}: {tok.convert_ids_to_tokens(free.token_ids)}"
    req = TurnRequest(prompt_ids=[9, 10, 11, 12], max_tokens=40, temperature=0.0, stop=(stop,))
    sent = []
    llm_generate = engine.llm.generate

    def recording(prompt, params, request_id):
        sent.append(list(params.stop_token_ids or []))
        return llm_generate(prompt, params, request_id)

    engine.llm.generate = recording
    try:
        with_id = await engine.generate(req)
        engine._stop_ids[(stop,)] = []  # the string alone
        string_only = await engine.generate(req)
    finally:
        engine.llm.generate = llm_generate
        engine._stop_ids.clear()
    assert sent == [[free.token_ids[j]], []]
    for out in (with_id, string_only):
        assert out.token_ids == free.token_ids[: j + 1] and out.text.endswith(stop)
        assert out.finish_reason == "stop" and out.stop_reason == stop
    assert with_id.logprobs == string_only.logprobs
