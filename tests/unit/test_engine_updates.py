"""Engine bookkeeping around weight updates: reload completeness (transformers engine) and the version labels of
a request an update overtakes when vLLM reports no per-token spans (the vLLM engine driven by a scripted
``AsyncLLM`` stand-in; the real engine runs in tests/integration/test_rollout_vllm.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.engine import HFEngine, TurnRequest, VLLMEngine, WeightsError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    return HFEngine.load(str(tiny_model_dir))


def test_hf_reload_refuses_missing_misshaped_or_mistyped_weights(hf_engine):
    state = {k: v.detach().clone() for k, v in hf_engine.model.state_dict().items()}
    bad = {
        "missing": {k: v * 2 for k, v in state.items() if ".layers.1." not in k},
        "shape": {**state, "model.norm.weight": state["model.norm.weight"][:-1]},
        "dtype": {**state, "model.norm.weight": state["model.norm.weight"].to(torch.float64)},
        "unknown": {**state, "model.layers.9.mlp.up_proj.weight": torch.ones(3)},
    }
    for problem, weights in bad.items():
        with pytest.raises(WeightsError, match=problem):
            asyncio.run(hf_engine.update_weights(7, weights))
        assert hf_engine.version == 0
    for k, v in hf_engine.model.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} changed by a refused update"
    asyncio.run(hf_engine.update_weights(1, {k: v.numpy() for k, v in state.items()}))  # complete: accepted
    assert hf_engine.version == 1


class _NoSpansLLM:
    """Yields one final output without ``weight_versions``; meanwhile a weight update lands (version bumped)."""

    def __init__(self):
        self.engine = None

    async def generate(self, prompt, params, request_id):
        self.engine.version += 1  # an update applied while this request runs
        step = {11: SimpleNamespace(logprob=-0.5)}, {12: SimpleNamespace(logprob=-0.25)}
        comp = SimpleNamespace(token_ids=[11, 12], logprobs=list(step), weight_versions=None, text="ab",
                               finish_reason="length", stop_reason=None)
        yield SimpleNamespace(outputs=[comp])


def test_tokens_without_version_spans_get_the_version_the_request_started_at():
    llm = _NoSpansLLM()
    engine = VLLMEngine(llm, 3, "cpu", params={}, aliases=set())
    llm.engine = engine
    out = asyncio.run(engine.generate(TurnRequest(prompt_ids=[1, 2], max_tokens=2)))
    assert out.versions == [3, 3] and engine.version == 4
    assert np.allclose(out.logprobs, [-0.5, -0.25])


def test_only_stop_strings_spelled_as_one_token_become_stop_token_ids(tok, qwen_tokenizer):
    from actors.engine import one_token_ids

    ids = one_token_ids(tok, ["</search>", "</answer>", "no such stop"])
    assert ids == [tok.convert_tokens_to_ids("</search>"), tok.convert_tokens_to_ids("</answer>")]
    # the real Qwen tokenizer spells the tags in several tokens: the strings alone stop them (in vLLM's front end)
    assert one_token_ids(qwen_tokenizer, ["</search>", "</answer>"]) == []
    assert one_token_ids(qwen_tokenizer, ["<|im_end|>"]) == [qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")]
