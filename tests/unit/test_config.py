from pathlib import Path

import pytest
import yaml

from async_agent_rl.config import ConfigError, load_config, parse_override

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert any(p.name == "quickstart.yaml" for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    # every key written in the file survives into the typed tree (nothing silently dropped)
    raw = yaml.safe_load(path.read_text())
    resolved = cfg.to_dict()

    def walk(node, ref, where):
        for k, v in node.items():
            assert k in ref, f"{where}{k} lost"
            if isinstance(v, dict) and isinstance(ref[k], dict):
                walk(v, ref[k], f"{where}{k}.")

    walk(raw, resolved, "")


def test_dotted_override_sets_nested_value_with_yaml_typing():
    cfg = load_config(None, ["algorithm.clip_ratio_high=0.28", "rollout.num_actors=3", "retriever.url=null"])
    assert cfg.algorithm.clip_ratio_high == pytest.approx(0.28)
    assert cfg.rollout.num_actors == 3 and cfg.retriever.url is None


def test_unknown_key_names_full_path_and_allowed_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.clip_ratio_hgh=0.3"])
    msg = str(e.value)
    assert "algorithm.clip_ratio_hgh" in msg and "clip_ratio_high" in msg


def test_unknown_nested_section_names_every_leaf():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["nosuch.section.key=1"])
    assert "nosuch.section.key" in str(e.value)


def test_bad_enum_value_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.kl_estimator=k9"])
    msg = str(e.value)
    assert "algorithm.kl_estimator" in msg and "'k3'" in msg


def test_bad_type_and_range_fail():
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config(None, ["rollout.max_turns=0"])
    with pytest.raises(ConfigError, match="learner.lr"):
        load_config(None, ["learner.lr=fast"])


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="mini_batch_size"):
        load_config(None, ["learner.batch_size=30", "learner.mini_batch_size=8"])


def test_override_syntax_errors():
    with pytest.raises(ConfigError):
        parse_override("no_equals_sign")
    with pytest.raises(ConfigError):
        parse_override(".a=1")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["run.name=x", "run.name.sub=1"])


def test_non_mapping_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(REPO / "configs/quickstart.yaml", ["learner.lr=0.5"])
    path = cfg.save(tmp_path / "resolved.yaml")
    again = load_config(path)
    assert again == cfg and again.learner.lr == 0.5


def test_config_reference_doc_is_current():
    from async_agent_rl.config import config_reference

    doc = (REPO / "docs" / "CONFIG.md").read_text()
    assert doc.strip() == config_reference().strip(), "regenerate: async-agent-rl config reference > docs/CONFIG.md"
    assert "`algorithm.clip_ratio_high`" in doc and "`buffer.max_staleness`" in doc


def test_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="multiple of rollout.group_size"):
        load_config(None, ["learner.batch_size=32", "learner.mini_batch_size=32", "rollout.group_size=5"])


def test_a_prompt_budget_that_fills_the_context_is_refused():
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \(1024\) must be below model.max_model_len \(1024\)"):
        load_config(None, ["data.max_prompt_length=1024", "model.max_model_len=1024"])
    load_config(None, ["data.max_prompt_length=1000", "model.max_model_len=1024", "rollout.max_response_length=24",
                       "rollout.max_obs_length=16"])  # a response budget that fits what the prompt leaves


@pytest.mark.parametrize("overrides, match", [
    (["rollout.top_p=0.9"], "rollout.top_p"), (["rollout.top_k=20"], "rollout.top_k"),
    (["weight_sync.method=nccl"], "weight_sync.method=collective"),
    (["weight_sync.method=collective", "weight_sync.backend=nccl"], "needs GPUs"),
    (["weight_sync.method=collective", "rollout.engine=hf"], "needs rollout.engine=vllm"),
])  # fmt: skip
def test_accepted_but_unsupported_settings_are_refused(overrides, match):
    """top_p / top_k: the learner recomputes log-probs without the filter; nccl: a backend of the collective
    method, on GPUs only; the collective method needs vLLM's workers."""
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
    load_config(None, ["weight_sync.method=collective"])  # gloo on CPU


def test_on_policy_needs_a_publish_every_step():
    """Staleness counts published versions: eta = 0 with a publish every 2 steps would be one step off-policy."""
    with pytest.raises(ConfigError, match="buffer.max_staleness=0 with weight_sync.every_steps=2"):
        load_config(None, ["buffer.max_staleness=0", "weight_sync.every_steps=2"])
    load_config(None, ["buffer.max_staleness=1", "weight_sync.every_steps=2"])


def test_frozen_parameters_must_be_regular_expressions():
    assert load_config(None, ["learner.frozen_parameters=[self_attn, mlp.down_proj]"]).learner.frozen_parameters == [
        "self_attn", "mlp.down_proj"]
    with pytest.raises(ConfigError, match=r"learner.frozen_parameters: .*'self_attn\(' is not a regular expression"):
        load_config(None, ['learner.frozen_parameters=["self_attn("]'])
