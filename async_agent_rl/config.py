"""One typed configuration tree for every component.

Loaded from YAML (``configs/*.yaml``) with dotted command-line overrides::

    async-agent-rl train --config configs/quickstart.yaml algorithm.clip_ratio_high=0.28 rollout.num_actors=2

Unknown keys and bad values fail with ``ConfigError``, naming the full dotted path and the allowed keys or values.
Relative paths in a config are resolved against the current working directory at run time (the repo root for the
README's commands, the job's working dir under ``ray job submit``).
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from async_agent_rl.errors import InputError


class ConfigError(InputError):
    """A configuration file or override is invalid. The message names every offending path."""


def _accepts_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return any(_accepts_bool(a) for a in typing.get_args(annotation))


class _Section(BaseModel):
    # no inf/nan anywhere: a non-finite learning rate or coefficient only shows up later as NaN losses
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's true/false are not the numbers 1/0: a boolean is accepted only where the key is a boolean."""
        if isinstance(value, bool) and not _accepts_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not the boolean {str(value).lower()}")
        return value


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP address (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot be an address to listen on: neither an IP address nor a host name by its syntax (labels
    of letters, digits and hyphens, the last not all digits, so ``999.1.1.1`` is no name either); None if it can."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return None
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if (0 < len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)
            and not labels[-1].isdigit()):
        return None
    return f"{host!r} is not an IP address (127.0.0.1, ::1) or a host name (localhost)"


# ----------------------------------------------------------------------------------------------------------- model
class TinyModelConfig(_Section):
    """Shape of the tiny model that ``model init`` builds (random init): Qwen2 by default, or Qwen3, whose head size
    is set apart from the width (vLLM's Qwen2 always serves ``hidden_size / num_attention_heads``, and its CPU
    attention needs a head size of at least 32, so more heads at width 128 take Qwen3)."""

    architecture: Literal["qwen2", "qwen3"] = Field(
        "qwen2", description="qwen3 adds per-head query/key RMSNorm, no q/k/v biases, and its own head_dim")
    head_dim: Optional[int] = Field(
        None, ge=8, description="size of one attention head; unset = hidden_size / num_attention_heads (qwen3 only)")

    vocab_size: int = Field(4096, ge=300, description="BPE vocabulary size, trained on the corpus")
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(512, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(2048, ge=64)
    tags_as_tokens: bool = Field(True, description="add <search>, </search>, ... as single (non-special) tokens")
    seed: int = 0

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelConfig":
        if self.head_dim is not None and self.architecture == "qwen2":
            raise ValueError("head_dim is set by hidden_size / num_attention_heads in qwen2; use architecture: qwen3")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class ModelConfig(_Section):
    path: str = Field("runs/quickstart/model", description="HF model folder (transformers and vLLM load it)")
    build_if_missing: bool = Field(False, description="build a tiny model from `init` at `path` when it is missing")
    init: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_model_len: int = Field(2048, ge=64, description="context length for the engine and the learner")
    trust_remote_code: bool = False


# ------------------------------------------------------------------------------------------------------------ data
class WorldConfig(_Section):
    """The embedded fictional search world (``data make-world``)."""

    seed: int = 0
    num_countries: int = Field(12, ge=2)
    num_cities: int = Field(60, ge=4)
    num_people: int = Field(400, ge=4)
    num_companies: int = Field(60, ge=2)
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of subject entities held out for test")
    two_hop_fraction: float = Field(0.3, ge=0.0, le=1.0, description="share of bridge (two-hop) questions")
    distractors_per_entity: int = Field(0, ge=0, description="extra near-duplicate passages per entity")


class DataConfig(_Section):
    world_dir: str = Field("runs/quickstart/world", description="where `data make-world` writes (default task)")
    make_world_if_missing: bool = Field(False, description="generate the world into world_dir when files are missing")
    world: WorldConfig = WorldConfig()
    train_files: list[str] = Field(default_factory=lambda: ["runs/quickstart/world/train.parquet"])
    test_files: list[str] = Field(default_factory=lambda: ["runs/quickstart/world/test.parquet"])
    corpus_file: str = "runs/quickstart/world/corpus.jsonl"
    prompt_template: Literal["search_r1", "minimal"] = Field(
        "search_r1", description="search_r1: Search-R1's instruction template; minimal: a one-line instruction"
    )
    prompt_from: Literal["template", "dataset"] = Field(
        "template", description="template: re-render the question; dataset: use the parquet's prompt as is"
    )
    apply_chat_template: bool = Field(True, description="instruct-style chat template (False: base-style plain text)")
    on_bad_row: Literal["error", "skip"] = "error"
    max_prompt_length: int = Field(512, ge=16, description="longer prompts are skipped (counted failed episode)")
    shuffle: bool = Field(True, description="rollout prompts in a fresh seeded order each pass (False: file order)")
    seed: int = 0


# ------------------------------------------------------------------------------------------------------- retriever
class RetrieverLimits(_Section):
    max_queries_per_request: int = Field(512, ge=1)
    max_query_chars: int = Field(2048, ge=1)
    max_topk: int = Field(100, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)


class SearchClientConfig(_Section):
    timeout_s: float = Field(5.0, gt=0)
    retries: int = Field(3, ge=0)
    backoff_base_s: float = Field(0.05, ge=0)
    backoff_max_s: float = Field(1.0, ge=0)
    deadline_s: float = Field(15.0, gt=0, description="total time one search may take, retries included")
    pool_size: int = Field(256, ge=1)


class ToolLimitsConfig(_Section):
    """Limits on the calls to the search tool, in the retrieval server (``retriever serve`` or ``retriever proxy``),
    shared by every rollout actor of a run. A query over a limit waits in the server, first come first served (no
    error); the wait counts toward the client's ``retriever.client.timeout_s``."""

    max_concurrent: int = Field(0, ge=0, description="queries in flight to the tool at once (0 = no cap); more wait")
    rate_per_s: float = Field(0.0, ge=0, description="token bucket: queries a second (0 = no rate limit); more wait")
    burst: int = Field(0, ge=0, description="token bucket size: queries that may go at once after a pause (0 = one "
                       "second's worth, max(1, rate_per_s))")


class RetrieverConfig(_Section):
    url: Optional[str] = Field(None, description="use an existing Search-R1-compatible server instead of starting one")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 = pick a free port")
    backend: Literal["bm25", "dense"] = "bm25"
    index_dir: Optional[str] = Field(None, description="index folder: loaded if it holds one, else built, saved there")
    dense_model: Optional[str] = Field(
        None, description="encoder folder of the dense backend: a sentence-transformers model, or a plain Hugging "
        "Face model (e5) encoded with attention-masked mean pooling")
    faiss_index: Optional[str] = Field(
        None, description="an existing FAISS inner-product index file over data.corpus_file (row i = corpus line i), "
        "e.g. Search-R1's e5_Flat.index; dense backend, encoder dense_model, no index_dir")
    query_prefix: str = Field("", description="dense backend: put before every query when encoding (e5: 'query: ')")
    passage_prefix: str = Field("", description="dense backend: put before every passage when building an index "
                                "(e5: 'passage: ')")
    topk: int = Field(3, ge=1)
    batch_window_ms: float = Field(2.0, ge=0, description="coalesce concurrent requests for this long (0 = off)")
    max_batch_queries: int = Field(256, ge=1)
    limits: RetrieverLimits = RetrieverLimits()
    latency: Literal["none", "local", "web"] = Field(
        "none", description="tool-latency model the server adds to every query (retriever/latency.py): none; local "
        "(median 20 ms); web (median 0.5 s, p99 ~3 s, 2% of calls hang until the client gives up)")
    latency_seed: int = Field(0, description="seed of the latency model: the same seed, the same delays in arrival "
                              "order")
    latency_hang_s: float = Field(60.0, gt=0, description="how long the server holds a call the latency model hangs "
                                  "(cut short when the client disconnects); keep it above client.timeout_s")
    tool_limits: ToolLimitsConfig = ToolLimitsConfig()
    client: SearchClientConfig = SearchClientConfig()

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        problem = host_problem(host)
        if problem is not None:
            raise ValueError(problem)
        return host

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: Optional[str]) -> Optional[str]:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"must be an http:// or https:// URL with a host, got {url!r}")
        return url

    @model_validator(mode="after")
    def _faiss_index_is_dense(self) -> "RetrieverConfig":
        if self.faiss_index is not None:
            if self.backend != "dense" or self.dense_model is None:
                raise ValueError("faiss_index needs backend: dense and dense_model (the encoder the index was built "
                                 "with)")
            if self.index_dir is not None:
                raise ValueError("set faiss_index or index_dir, not both")
        return self

    @model_validator(mode="after")
    def _slow_tool_needs_own_server(self) -> "RetrieverConfig":
        t = self.tool_limits
        if self.url is not None and (self.latency != "none" or t.max_concurrent or t.rate_per_s):
            raise ValueError("latency and tool_limits act in the server this run starts, and with url it starts none: "
                             "run `async-agent-rl retriever proxy --upstream URL --latency ... --max-concurrent ...` "
                             "in front of that server and set url to the proxy")
        return self


# --------------------------------------------------------------------------------------------------------- rollout
class RolloutConfig(_Section):
    engine: Literal["vllm", "hf"] = Field("vllm", description="hf = transformers generate, a correctness reference")
    mode: Literal["async", "sync"] = Field(
        "async", description="sync = batch-synchronous baseline: admitted episodes run as one wave, turn by turn in "
        "lockstep, next wave when all are done (with buffer.max_staleness=0: synchronous RL)")
    num_actors: int = Field(1, ge=1)
    max_concurrent_episodes: int = Field(32, ge=1, description="episodes in flight per actor")
    group_size: int = Field(5, ge=1, description="GRPO n: independent episodes per prompt sharing a group id")
    max_turns: int = Field(4, ge=1)
    max_tokens_per_turn: int = Field(128, ge=1, description="per-turn cap (DeepEyes): one turn cannot starve the rest")
    max_response_length: int = Field(512, ge=1, description="total response budget: model turns + observations")
    max_obs_length: int = Field(256, ge=8, description="observation tokens per search, closing tag kept")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1, description="only 1.0: the learner recomputes log-probs unfiltered")
    top_k: int = Field(-1, ge=-1, description="only -1: the learner recomputes log-probs unfiltered")
    weight_update_mode: Literal["pause", "inflight"] = "pause"
    push_batch_size: int = Field(8, ge=1, description="trajectories per push to the buffer")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU")
    gpu_memory_utilization: float = Field(0.8, gt=0, le=1)
    enforce_eager: bool = True
    multiprocess_engine: bool = Field(False, description="vLLM V1 multiprocessing (extra EngineCore process)")
    engine_silence_s: float = Field(
        0.0, ge=0, description="engine health probe: generate requests in flight with none finished this long (a "
        "weight update's pause counted from its own start) stop the actor's worker, and supervision restarts the actor; 0: derived, "
        "max(180, 10 x max_tokens_per_turn / 10 tokens/s), at most half of cluster.progress_timeout_s when that is "
        "set; a value set here must be below cluster.progress_timeout_s")
    seed: int = 0

    @field_validator("top_p", "top_k")
    @classmethod
    def _unfiltered(cls, value: float, info: Any) -> float:
        # behavior log-probs would be of the filtered distribution, the learner's of the full one: every importance
        # weight would be off by the kept probability mass
        if value != cls.model_fields[info.field_name].default:
            raise ValueError(f"only {cls.model_fields[info.field_name].default} is supported: the learner recomputes "
                             "log-probs without a nucleus / top-k filter")
        return value


# ---------------------------------------------------------------------------------------------------------- buffer
class BufferConfig(_Section):
    max_staleness: int = Field(2, ge=0, description="eta: max learner_version - min token version, in published "
                               "policy versions (weight_sync.every_steps learner steps each); 0 = on-policy")
    capacity_trajectories: int = Field(4096, ge=1, description="stored trajectories at most; at least "
                                       "learner.batch_size (a batch is taken whole)")
    capacity_tokens: int = Field(8_000_000, ge=1, description="stored prompt + response tokens at most; at least "
                                 "learner.batch_size x (data.max_prompt_length + rollout.max_response_length), a "
                                 "batch of the longest trajectories")
    sampling: Literal["fifo", "priority"] = "fifo"
    partial_groups: Literal["wait", "release", "drop"] = Field(
        "wait", description="groups with missing members: wait for them, release what arrived, or drop (counted)"
    )
    partial_group_timeout_s: float = Field(300.0, gt=0)
    group_filter: Literal["none", "zero_variance"] = Field(
        "none", description="zero_variance: drop groups whose rewards are all equal (no GRPO signal); counted, "
        "and the batch is filled from the groups that follow")
    zero_variance_tol: float = Field(1e-6, ge=0, description="rewards closer than this count as equal")
    group_filter_max_streak: int = Field(
        64, ge=1, description="after this many filtered groups in a row the filter stands aside (counted) until a "
        "group with a reward spread arrives: a policy with no signal at all must not stall the run")
    snapshot_dir: Optional[str] = None
    snapshot_every_steps: int = Field(0, ge=0)


# ------------------------------------------------------------------------------------------------------- algorithm
class AlgorithmConfig(_Section):
    advantage_estimator: Literal["grpo", "grpo_no_std", "rloo", "reinforce_pp", "gae"] = "grpo"
    stepwise_advantage: Literal["none", "broadcast", "per_step"] = "none"
    gamma: float = Field(1.0, gt=0, le=1)
    lam: float = Field(1.0, gt=0, le=1)
    whiten_advantages: bool = False
    policy_loss: Literal["ppo", "decoupled_ppo"] = "decoupled_ppo"
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    dual_clip_c: Optional[float] = Field(3.0, gt=1.0, description="dual-clip constant for A<0, > 1 (None disables)")
    behavior_weight_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="behavior weights above behavior_weight_cap: truncate to the cap, or mask (weight 0)")
    behavior_weight_cap: float = Field(2.0, gt=1.0)
    behavior_weight_level: Literal["token", "sequence", "turn"] = Field(
        "token", description="what one behavior weight covers (docs/ALGORITHMS.md section 3): token exp(proximal - "
        "behavior); sequence: the geometric mean over the sequence's sampled tokens, for all its tokens; turn: the "
        "same per assistant turn. The cap (behavior_weight_mode) applies to that weight")
    icepop_band: Optional[tuple[float, float]] = Field(
        None, description="[low, high] with 0 <= low < 1 < high: tokens whose own behavior weight lies outside it get "
        "weight 0 (IcePop); null: off")
    behavior_weight_floor: Optional[float] = Field(
        None, gt=0, lt=1, description="a sequence with any sampled token's behavior weight below this gets weight 0 "
        "(floor veto); null: off")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    entropy_coef: float = Field(0.0, ge=0)
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference loss coefficient (Search-R1 GRPO: 0.001)")
    kl_estimator: Literal["k1", "abs", "k2", "k3"] = "k3"
    vf_coef: float = Field(0.5, ge=0)
    value_clip: float = Field(0.2, ge=0)
    mask_observations: bool = Field(True, description="observation tokens take no loss (Search-R1's ablation knob)")
    proximal: Literal["recompute", "skip_fresh", "interpolate", "behavior"] = Field(
        "skip_fresh", description="where decoupled_ppo's proximal log-probs come from (docs/ALGORITHMS.md section 3): "
        "recompute: a no-grad forward pass every step; skip_fresh: no pass for a batch whose loss tokens are all "
        "fresh (proximal := behavior, exact up to the engine/trainer mismatch; never with icepop_band or "
        "behavior_weight_floor, which judge that mismatch), the pass otherwise; interpolate: no pass, AReaL's "
        "log-linear interpolation between behavior and live log-probs by version; behavior: no pass, proximal := "
        "behavior (verl's bypass: the PPO clip of live / behavior is the only correction)")

    @field_validator("icepop_band")
    @classmethod
    def _icepop_band(cls, v: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
        if v is not None and not 0 <= v[0] < 1 < v[1]:
            raise ValueError(f"needs [low, high] with 0 <= low < 1 < high, got [{v[0]}, {v[1]}]")
        return v

    @model_validator(mode="after")
    def _proximal(self) -> "AlgorithmConfig":
        # under policy_loss=ppo the key does nothing (no proximal policy), as the behavior_weight_* keys: a staleness
        # sweep's standard-PPO arm runs with the sweep's proximal setting
        if self.proximal in ("interpolate", "behavior") and not self.mask_observations:
            raise ValueError(f"proximal={self.proximal} needs mask_observations=true (an observation taking the loss "
                             "was never sampled: it has no behavior log-prob to stand for its proximal one)")
        return self


class RewardTerm(_Section):
    name: Literal["exact_match", "substring_match", "f1", "format", "tag_count", "retrieval_hit", "format_em",
                  "search_r1_em"]
    weight: float = 1.0


class RewardConfig(_Section):
    terms: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm(name="exact_match", weight=1.0)], min_length=1,
        description="at least one term: with none every reward is 0 and nothing is learned")


# --------------------------------------------------------------------------------------------------------- learner
class LearnerConfig(_Section):
    total_steps: int = Field(20, ge=0)
    batch_size: int = Field(40, ge=1, description="trajectories per learner step (a multiple of rollout.group_size)")
    mini_batch_size: int = Field(40, ge=1, description="trajectories per optimizer update")
    micro_batch_size: int = Field(8, ge=1, description="trajectories per forward/backward")
    ppo_epochs: int = Field(1, ge=1)
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    grad_clip: float = Field(1.0, gt=0)
    zero_stage: Literal[0, 1, 2, 3] = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    num_ranks: int = Field(1, ge=1)
    use_reference_model: bool = False
    freeze_embeddings: bool = Field(
        False, description="keep the token embeddings (and an output head tied to them) fixed: RL then changes how "
        "the model reads and copies, not the tokens themselves (a small model whose embeddings train on a few "
        "rewarded answers learns to emit them from memory instead of copying them from the observation)")
    frozen_parameters: list[str] = Field(
        default_factory=list, description="regular expressions (searched in the policy's parameter names, e.g. "
        "`model.layers.0.self_attn.q_proj.weight`); every parameter one of them finds is kept fixed in RL, e.g. "
        "[self_attn] keeps every attention projection, where a small model's copying of an observation's value "
        "lives, so RL's updates reach only the MLPs, norms and embeddings; a pattern that finds no parameter, or "
        "patterns that find all of them, are an error")
    critic_lr: float = Field(1e-5, gt=0)
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints (0 = only at the end)")
    seed: int = 0

    @field_validator("frozen_parameters")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression ({e})") from None
        return v

    @model_validator(mode="after")
    def _batches(self) -> "LearnerConfig":
        if self.batch_size % self.mini_batch_size:
            raise ValueError("batch_size must be a multiple of mini_batch_size")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError("mini_batch_size must be a multiple of micro_batch_size")
        return self


class WeightSyncConfig(_Section):
    every_steps: int = Field(1, ge=1, description="publish weights (bump the version) every k learner steps")
    method: Literal["object_store", "collective"] = Field(
        "object_store", description="object_store: through Ray's object store (a RAM file into vLLM); collective: "
        "the learner's rank 0 broadcasts into every engine's workers (driver/weight_sync.py)")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="collective: the process group's backend; auto = gloo on CPU, nccl on GPU")
    timeout_s: float = Field(300.0, gt=0, description="collective: how long a member waits for the others (joining "
                                                      "the group, one publish) before it fails")

    @field_validator("method", mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        if value == "nccl":
            raise ValueError("nccl is a backend of the collective method: use weight_sync.method=collective "
                             "(weight_sync.backend=auto picks nccl on GPU)")
        return value


class SFTConfig(_Section):
    enabled: bool = Field(False, description="train: supervised warm start on demonstrations before RL")
    num_demos: int = Field(2000, ge=1)
    pretrain_steps: int = Field(
        0, ge=0, description="embedded world only: LM steps on shuffled-fact passages first (teaches copying names)"
    )
    pretrain_questions: bool = Field(
        False, description="pretraining: follow each shuffled-fact observation with questions about it and their "
        "answers, so every kind of value (years, occupations, names) is read and copied, not only the names that "
        "repeat inside a passage")
    pretrain_questions_per_doc: int = Field(
        1, ge=1, description="pretrain_questions: reading exercises per document shown (drawn without repeats from "
        "the questions about the shown documents): 1 asks about one fact of each on average, 4 about every fact of "
        "a person")
    pretrain_packing: Literal["windows", "texts"] = Field(
        "windows", description="how pretraining cuts its batches: 'windows' = random fixed-length windows of the "
        "concatenated texts (a window often holds a reading exercise but not the passage it asks about: measured "
        "on the quickstart world, 70% of the exercises a 128-token window holds lack their passage, and teach a "
        "guess); 'texts' = whole observations, one per row, right-padded, so every exercise is answerable from "
        "what the row shows")
    pretrain_answer_weight: float = Field(
        1.0, ge=1.0, description="pretrain_packing=texts: the loss weight of a reading exercise's answer tokens "
        "against every other token's 1 (the loss is the weighted mean); the answers are a few percent of the "
        "tokens, the rest mostly unpredictable shuffled values")
    shuffled_copies: int = Field(
        0, ge=0, description="embedded world only: draw the demonstrations from this many fact-shuffled copies of "
        "the world (train subjects, each copy with its own index) instead of the true train facts, so the warm "
        "start learns to read answers rather than memorize them (0 = the true train questions)")
    expert_search_prob: float = Field(
        1.0, ge=0.0, le=1.0, description="share of demonstrations in which the scripted expert searches; the rest "
        "answer at once with a guess (the relation's most common train answer), as a model answering from memory does")
    frozen_embeddings: Literal["names", "corpus", "all"] = Field(
        "names", description="embedding rows kept fixed in the demonstrations stage after pretraining: the tokens of "
        "entity names (the corpus titles); every token of the corpus passages (names and every value: a year's "
        "digits, an occupation), so a value can be produced only by the layers, as a copy of what the observation "
        "shows, while the turns' own words still train; or every row")
    guess_value_loss: bool = Field(
        True, description="train the guessed value of a guess demonstration (sft.expert_search_prob < 1) as a target; "
        "false masks the value's tokens out of the loss, so the warm start learns when a guess is made but not what "
        "to guess: no constant answer per relation for reading to compete with")
    expert_second_hop_prob: float = Field(
        1.0, ge=0.0, le=1.0, description="share of searching bridge demonstrations that make the second search; the "
        "rest stop after the first and answer the bridge entity they found")
    reading_target: float = Field(
        0.0, ge=0.0, le=1.0, description="embedded world only: after the demonstrations stage, check per relation "
        "that the model reads its answer in thorough episodes on a fact-shuffled copy of the world (teacher-forced, "
        "train subjects, warm_start.reading); while a relation reads below this share, train reading_round_steps "
        "more on thorough episodes of fact-shuffled copies, half of them of the relations below it (0: no check)")
    reading_round_steps: int = Field(250, ge=1, description="reading_target: optimizer steps per round")
    reading_max_rounds: int = Field(4, ge=0, description="reading_target: rounds at most (then the warm start "
                                    "ends with whatever it reads, said in one line and in sft_summary.json); 0: the "
                                    "check alone, to screen a warm-start recipe by what it reads without any RL")
    epochs: int = Field(2, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW's decoupled weight decay in every stage of the warm start, on the attention "
        "and MLP matrices only (never the embeddings, whose frozen rows must not move, nor the norms): a pull "
        "toward small weights, which costs a per-entity memorized answer more than a copy from the passage")
    warmup_steps: int = Field(20, ge=0)
    seed: int = 0
    threads: int = Field(
        0, ge=0, description="torch threads of the warm start's loops (0: picked from the loop's own step times, "
        "a speed choice that leaves the computed numbers unchanged; the learning study pins 1 and 2 to check that)")
    output_dir: Optional[str] = Field(
        None, description="train: where the warm start is saved and reused (default RUN_DIR/sft); runs with the "
        "same inputs can share one (checked against its warm_start_inputs.json)")
    prebuilt: Optional[str] = Field(
        None, description="train: a warm start made before (by `async-agent-rl sft`) to start from instead of making "
        "one, used only when its warm_start_fingerprint.json equals this run's (settings, base model, demonstrations, "
        "pretraining texts); else the warm start is made and the line says what differs")

    @model_validator(mode="after")
    def _answer_weight(self) -> "SFTConfig":
        if self.pretrain_answer_weight != 1.0 and (self.pretrain_packing != "texts" or not self.pretrain_questions):
            raise ValueError("pretrain_answer_weight needs pretrain_packing: texts and pretrain_questions: true (it "
                             "weighs the reading exercises' answers, which a window cuts apart)")
        return self


class EvalConfig(_Section):
    num_questions: int = Field(200, ge=0, description="held-out questions per evaluation (0 = all)")
    at_start: bool = True
    at_end: bool = True
    every_steps: int = Field(0, ge=0, description="also evaluate every k learner steps (0 = start and end only)")
    beside: bool = Field(
        False, description="run the every_steps evaluations beside training, on an engine of their own (one more "
        "rollout-sized Ray actor): the learner's weights of that step are loaded into it and evaluated while the RL "
        "loop goes on; each result is written when it is done, tagged with the step and version it measured. One "
        "runs at a time: one due while another runs is skipped (counted, one line). false: the loop waits for each "
        "evaluation on rollout actor 0")


class MonitoringConfig(_Section):
    enabled: bool = True
    allow_remote: bool = Field(False, description="allow a non-loopback monitoring.host (the metrics are unauthenticated)")
    host: str = Field("127.0.0.1", description="bind address of the exporters: loopback unless allow_remote")
    exporter_port: int = Field(0, ge=0, le=65535, description="0 = free port per process")
    prometheus_sd_file: Optional[str] = Field(None, description="file-based service discovery targets (JSON)")
    log_every_s: float = Field(5.0, gt=0)
    episodes_per_step: int = Field(4, ge=0, description="training episodes kept per learner step in RUN_DIR/episodes/ "
                                   "for the run viewer (`async-agent-rl view`); 0 = none")
    final_scrape_timeout_s: float = Field(
        15.0, ge=0, description="at the end of a run, wait this long for Prometheus to scrape the last values "
        "(only if it has scraped the run before; 0 = don't wait)")

    @field_validator("host")
    @classmethod
    def _loopback_unless_allowed(cls, host: str, info: ValidationInfo) -> str:
        if not info.data.get("allow_remote") and not is_loopback(host):
            raise ValueError(f"{host!r} is not a loopback address and the metrics endpoints are unauthenticated; "
                             "set monitoring.allow_remote=true to expose them anyway")
        return host


class ClusterConfig(_Section):
    ray_address: Optional[str] = Field(None, description="None: start a local Ray; 'auto' or an address: connect")
    num_cpus: Optional[int] = Field(None, ge=1)
    rollout_actor_cpus: float = Field(0.5, ge=0)
    rollout_actor_gpus: float = Field(0.0, ge=0)
    learner_cpus: float = Field(0.5, ge=0)
    learner_gpus: float = Field(0.0, ge=0)
    buffer_cpus: float = Field(0.0, ge=0)
    rollout_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources each rollout actor asks for (name: amount, e.g. "
        "{rollout_node: 1}): the actors go only to nodes that offer them (ray start --resources); {}: anywhere")
    learner_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources each learner rank asks for (as rollout_resources); "
        "the ranks must share one machine (their process group is on loopback)")
    buffer_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources the replay buffer actor asks for (as "
        "rollout_resources)")
    max_actor_restarts: int = Field(3, ge=0, description="times Ray restarts a dead rollout actor (then the run fails)")
    actor_timeout_s: float = Field(120.0, gt=0, description="a rollout actor silent this long is treated as dead")
    actor_setup_timeout_s: float = Field(
        900.0, gt=0, description="a restarted rollout actor must be set up again (engine built, model loaded) within "
        "this long, or the run ends in one error: line; large models on GPUs load for minutes")
    progress_timeout_s: Optional[float] = Field(
        None, ge=0, description="no learner step completed this long: the run saves a checkpoint and ends in one "
        "error: line naming the blocked component; null: max(600, 10 x the slowest step so far); 0: never")
    env_vars: dict[str, str] = Field(default_factory=dict)

    @field_validator("rollout_resources", "learner_resources", "buffer_resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if not name.strip():
                raise ValueError("a resource name must not be empty")
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is one of Ray's own resources: ask for CPUs and GPUs with "
                                 "cluster.*_cpus and cluster.*_gpus; these keys name custom resources")
            if not amount > 0:
                raise ValueError(f"{name}: {amount:g}: an amount must be above 0")
        return resources


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RunConfig(_Section):
    name: str = Field("quickstart", description="the run's folder under output_dir: one plain name, no path")
    output_dir: str = "runs"
    device: Literal["cpu", "cuda"] = "cpu"
    delete_earlier_run: bool = Field(
        False, description="a fresh run in a folder holding an earlier run's results deletes them; false: they move "
        "to the next free RUN_DIR.N beside it (RUN_DIR.1, RUN_DIR.2, ...), nothing deleted")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # the run folder (output_dir/name) is written, and a bench arm's reused: it must stay inside output_dir
        if not name.strip() or name in (".", "..") or any(sep in name for sep in ("/", "\\")) or "\x00" in name:
            raise ValueError("must be one plain folder name inside run.output_dir (no path separator, not . or ..)")
        return name


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    retriever: RetrieverConfig = RetrieverConfig()
    rollout: RolloutConfig = RolloutConfig()
    buffer: BufferConfig = BufferConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig = RewardConfig()
    learner: LearnerConfig = LearnerConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _cross_section(self) -> "Config":
        if self.learner.batch_size % self.rollout.group_size:
            raise ValueError(
                f"learner.batch_size ({self.learner.batch_size}) must be a multiple of rollout.group_size "
                f"({self.rollout.group_size}): the buffer hands out whole GRPO groups"
            )
        if self.data.max_prompt_length >= self.model.max_model_len:
            raise ValueError(
                f"data.max_prompt_length ({self.data.max_prompt_length}) must be below model.max_model_len "
                f"({self.model.max_model_len}): a prompt that fills the context leaves no token to generate"
            )
        context_left = self.model.max_model_len - self.data.max_prompt_length
        if self.rollout.max_response_length > context_left:
            raise ValueError(
                f"rollout.max_response_length ({self.rollout.max_response_length}) must be at most model.max_model_len "
                f"- data.max_prompt_length ({self.model.max_model_len} - {self.data.max_prompt_length} = "
                f"{context_left}): a budget the context cannot hold is never reached, yet the learner normalises "
                "losses by it"
            )
        if self.rollout.max_obs_length > self.rollout.max_response_length:
            raise ValueError(
                f"rollout.max_obs_length ({self.rollout.max_obs_length}) must be at most rollout.max_response_length "
                f"({self.rollout.max_response_length}): one search result would use up the whole response budget"
            )
        if self.buffer.capacity_trajectories < self.learner.batch_size:
            raise ValueError(
                f"buffer.capacity_trajectories ({self.buffer.capacity_trajectories}) must be at least "
                f"learner.batch_size ({self.learner.batch_size}): a batch is taken from the buffer whole, so one "
                "that cannot fit never comes and the run waits forever"
            )
        # the buffer's own rule (buffer.replay_buffer, "Capacity and backpressure"): it promises every missing member
        # of a group under way max_trajectory_tokens, so at this capacity and up a batch always forms, at any push
        # order; below it a batch of the longest trajectories never fits
        batch_tokens = self.learner.batch_size * self.max_trajectory_tokens
        if self.buffer.capacity_tokens < batch_tokens:
            raise ValueError(
                f"buffer.capacity_tokens ({self.buffer.capacity_tokens}) must be at least learner.batch_size x "
                f"(data.max_prompt_length + rollout.max_response_length) ({self.learner.batch_size} x "
                f"({self.data.max_prompt_length} + {self.rollout.max_response_length}) = {batch_tokens}): a batch "
                "is taken from the buffer whole and each of its trajectories may be that long, so a smaller buffer "
                "may never hold one and the run would wait forever"
            )
        if self.buffer.max_staleness == 0 and self.weight_sync.every_steps > 1:
            raise ValueError(
                f"buffer.max_staleness=0 with weight_sync.every_steps={self.weight_sync.every_steps}: staleness "
                "counts published versions, so the learner would train up to "
                f"{self.weight_sync.every_steps - 1} steps off-policy while reporting 0; use every_steps=1 for "
                "on-policy training"
            )
        if self.weight_sync.method == "collective" and self.rollout.engine != "vllm":
            raise ValueError(f"weight_sync.method=collective needs rollout.engine=vllm (the {self.rollout.engine!r} "
                             "engine has no workers to join the broadcast group); use object_store")
        if self.weight_sync.method == "collective" and self.weight_sync.backend == "nccl" and self.run.device == "cpu":
            raise ValueError("weight_sync.backend=nccl needs GPUs (run.device=cpu); use gloo or auto")
        silence, watchdog = self.rollout.engine_silence_s, self.cluster.progress_timeout_s
        if silence and watchdog and silence >= watchdog:
            raise ValueError(
                f"rollout.engine_silence_s ({silence:g}) must be below cluster.progress_timeout_s ({watchdog:g}): a "
                "hung engine's actor must be restarted before the run is declared stalled (0 derives a limit that is)"
            )
        if self.eval.beside and not self.eval.every_steps:
            raise ValueError("eval.beside=true needs eval.every_steps > 0: it runs the every_steps evaluations beside "
                             "training (the start and end ones always run on rollout actor 0)")
        if self.buffer.group_filter != "none" and self.rollout.group_size < 2:
            raise ValueError(
                f"buffer.group_filter={self.buffer.group_filter!r} needs rollout.group_size >= 2 (got "
                f"{self.rollout.group_size}): a group of one always has equal rewards"
            )
        return self

    @property
    def max_trajectory_tokens(self) -> int:
        """The longest trajectory the buffer may be given: a prompt of ``data.max_prompt_length`` (longer ones are
        skipped) and a response (model and observation tokens) of ``rollout.max_response_length``, which the
        context bounds (``model.max_model_len``). The replay buffer promises it to every member of a group under way
        (and refuses a longer trajectory); ``buffer.capacity_tokens`` must hold ``learner.batch_size`` of them."""
        return min(self.model.max_model_len, self.data.max_prompt_length + self.rollout.max_response_length)

    def actor_asks(self, resource: str) -> list[tuple[str, int, float]]:
        """What the run's Ray actors ask for of ``resource`` ("CPU", "GPU" or a custom resource): (which, how many,
        each)."""
        c, n_actors, n_ranks = self.cluster, self.rollout.num_actors, self.learner.num_ranks
        evaluator = [("evaluator", self.evaluators)] if self.evaluators else []
        if resource == "CPU":
            return [("buffer", 1, c.buffer_cpus), ("rollout actors", n_actors, c.rollout_actor_cpus),
                    ("learner ranks", n_ranks, c.learner_cpus), *((w, n, c.rollout_actor_cpus) for w, n in evaluator)]
        if resource == "GPU":
            return [("rollout actors", n_actors, c.rollout_actor_gpus), ("learner ranks", n_ranks, c.learner_gpus),
                    *((w, n, c.rollout_actor_gpus) for w, n in evaluator)]
        return [(which, n, asks.get(resource, 0.0)) for which, n, asks in self.placement()]

    def placement(self) -> list[tuple[str, int, dict[str, float]]]:
        """The run's Ray actors by kind with everything each one asks Ray for (CPU, GPU and the custom resources of
        ``cluster.*_resources``): (which, how many, resource: amount). Zero amounts are left out."""
        c = self.cluster
        kinds = [("buffer", 1, c.buffer_cpus, 0.0, c.buffer_resources),
                 ("rollout actors", self.rollout.num_actors, c.rollout_actor_cpus, c.rollout_actor_gpus,
                  c.rollout_resources),
                 ("learner ranks", self.learner.num_ranks, c.learner_cpus, c.learner_gpus, c.learner_resources),
                 ("evaluator", self.evaluators, c.rollout_actor_cpus, c.rollout_actor_gpus, c.rollout_resources)]
        return [(which, n, {k: v for k, v in {"CPU": cpus, "GPU": gpus, **custom}.items() if v})
                for which, n, cpus, gpus, custom in kinds if n]

    @property
    def evaluators(self) -> int:
        """The evaluation engines beside training the run starts (``eval.beside``, asked like a rollout actor):
        none when no evaluation falls due before the last step (the end one runs on rollout actor 0)."""
        return int(self.eval.beside and 0 < self.eval.every_steps < self.learner.total_steps)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        """Write the resolved config (every default filled in) as YAML."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
        return path


# ------------------------------------------------------------------------------------------------ loading and errors
def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` -> (["a", "b", "c"], value parsed as YAML). ``a.b=`` gives None."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from None
    return key.split("."), value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    for text in overrides:
        path, value = parse_override(text)
        node = tree
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[: i + 1])} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return tree


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: Any = Config
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _leaf_paths(value: Any, prefix: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaf_paths(v, f"{prefix}.{k}")]
    return [prefix]


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            allowed = sorted(parent.model_fields) if parent else []
            leaves = _leaf_paths(e.get("input"), path)
            shown = path if leaves == [path] else f"{path} (given as {', '.join(leaves)})"
            lines.append(f"  {shown}: unknown key; allowed keys here: {', '.join(allowed)}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {path}: {e['msg']}{shown}")
    return "\n".join(lines)


def build_config(tree: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden, as YAML says
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if first is not None:
                raise _DuplicateKey(f"line {key_node.start_mark.line + 1}: duplicate key {key!r} (first on line "
                                    f"{first}; YAML would keep the last one silently)")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply dotted overrides."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder, not a YAML file")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        try:
            tree = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        except _DuplicateKey as e:
            raise ConfigError(f"config file {path}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(tree).__name__}")
    if overrides:
        tree = apply_overrides(tree, overrides)
        source += " + overrides"
    return build_config(tree, source)


def config_reference() -> str:
    """Markdown reference of every section and key: type, default, description (docs/CONFIG.md)."""
    import typing

    import pydantic_core

    lines = ["# Config reference", "", "Generated by `async-agent-rl config reference`; every key, its type and default.",
             "Override any key on the command line as `section.key=value` (YAML syntax for the value).", ""]

    def type_name(ann: Any) -> str:
        if typing.get_origin(ann) is Literal:
            return " \\| ".join(repr(a) for a in typing.get_args(ann))
        return getattr(ann, "__name__", str(ann)).replace("typing.", "").replace("|", "\\|")

    def walk(model: type[BaseModel], prefix: str) -> None:
        rows = []
        subs = []
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subs.append((f"{prefix}{name}", ann))
                continue
            default = pydantic_core.to_jsonable_python(f.get_default(call_default_factory=True))
            rows.append(f"| `{prefix}{name}` | {type_name(ann)} | `{json.dumps(default)}` | {f.description or ''} |")
        if rows:
            lines.extend([f"## `{prefix.rstrip('.') or 'root'}`", "", "| key | type | default | meaning |",
                          "|---|---|---|---|", *rows, ""])
        for sub_prefix, sub in subs:
            walk(sub, sub_prefix + ".")

    walk(Config, "")
    return "\n".join(lines)
