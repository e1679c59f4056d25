"""Idempotent preparation of a run's inputs: the embedded world and the tiny model, only where the config asks.

A user's own paths are never filled with generated stand-ins: a missing file that the config does not allow us to
build is an error naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from async_agent_rl.config import Config, ConfigError
from async_agent_rl.data.world import generate_world, write_world
from async_agent_rl.tiny_model import TINY_MODEL_FILE, init_tiny_model


def _missing(paths: list[str]) -> list[str]:
    return [p for p in paths if not Path(p).is_file()]


def prepare(cfg: Config, force: bool = False) -> Iterator[str]:
    """Yield one line per action taken (or found already done)."""
    data_files = [*cfg.data.train_files, *cfg.data.test_files, cfg.data.corpus_file]
    missing = _missing(data_files)
    if (missing or force) and cfg.data.make_world_if_missing:
        world = generate_world(cfg.data.world)
        write_world(world, cfg.data.world_dir, template=cfg.data.prompt_template)
        yield (
            f"generated the search world (seed {cfg.data.world.seed}): {len(world.entities)} passages, "
            f"{len(world.train)} train / {len(world.test)} test questions -> {cfg.data.world_dir}"
        )
        missing = _missing(data_files)
    elif not missing:
        yield f"data present: {', '.join(data_files)}"
    if missing:
        raise ConfigError(f"data files missing: {', '.join(missing)} (set data.make_world_if_missing=true to generate)")

    model_dir = Path(cfg.model.path)
    has_model = (model_dir / "config.json").is_file()
    build = (not has_model or force) and cfg.model.build_if_missing
    problem = engine_head_size_problem(cfg, None if build else model_dir)  # a model to build: judged before it is
    if problem:
        raise ConfigError(problem)
    if has_model and not build and cfg.model.build_if_missing:
        problem = built_model_problem(cfg, model_dir)
        if problem:
            raise ConfigError(problem)
    if build:
        init_tiny_model(model_dir, cfg.model.init, cfg.data.corpus_file)
        yield f"built a tiny {cfg.model.init.architecture} model (hidden {cfg.model.init.hidden_size}, {cfg.model.init.num_hidden_layers} layers) -> {model_dir}"
    elif has_model:
        yield f"model present: {model_dir}"
    else:
        raise ConfigError(f"model.path {model_dir} has no config.json (set model.build_if_missing=true to build a tiny one)")


def built_model_problem(cfg: Config, model_dir: Path) -> str | None:
    """Why a tiny model present at ``model_dir``, built from another ``model.init`` than the config's (its
    ``tiny_model.json``), must not be used as if it were the config's, or None. A run with ``build_if_missing``
    builds once and reuses the folder; after the config's model changes (a new default shape) the old folder would
    otherwise be trained under the new config's name. A folder without that file (a user's own model) is not
    judged."""
    from async_agent_rl.config import TinyModelConfig

    try:
        saved = TinyModelConfig(**json.loads((model_dir / TINY_MODEL_FILE).read_text())).model_dump()
    except OSError:
        return None
    except (ValueError, TypeError) as e:
        why = str(e).strip().splitlines()[0]
        return f"model.path {model_dir}: {TINY_MODEL_FILE} is not a tiny model's recipe ({why}); delete the folder"
    want = cfg.model.init.model_dump()
    diff = [f"{k} {saved[k]} (model.init: {want[k]})" for k in want if saved.get(k) != want[k]]
    if not diff:
        return None
    return (f"model.path {model_dir} holds a tiny model built from another model.init: {', '.join(diff)}; delete "
            f"the folder (or `async-agent-rl prepare --force`) to build the config's, or point model.path elsewhere")


# The attention head sizes vLLM's CPU attention backend serves (its ``get_supported_head_sizes``); another size
# starts the engine and kills it at the first request (EngineDeadError), so it is refused before anything starts.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def engine_head_size_problem(cfg: Config, model_dir: Path | None) -> str | None:
    """Why the rollout engine cannot serve the model at ``model_dir``, or the one ``model.init`` would build when
    ``model_dir`` is None (vLLM on CPU: its attention head size), or None."""
    if cfg.rollout.engine != "vllm" or cfg.run.device != "cpu":
        return None
    if model_dir is None:
        init = cfg.model.init
        if init.head_dim:
            head, where = init.head_dim, "model.init.head_dim"
            fix = "choose head_dim so that it is"
        else:
            head = init.hidden_size // init.num_attention_heads
            where = f"model.init (hidden_size {init.hidden_size} / num_attention_heads {init.num_attention_heads})"
            fix = "choose num_attention_heads so that it is (or architecture: qwen3 with its own head_dim)"
    else:
        try:
            mc = json.loads((model_dir / "config.json").read_text())
            head = int(mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return None  # an unreadable config is reported by whatever loads the model
        where = f"model.path {model_dir}"
        fix = ("a model built from model.init stays until removed: delete the folder (or `async-agent-rl prepare "
               "--force`) after changing model.init" if cfg.model.build_if_missing else "serve another model")
    if head in VLLM_CPU_HEAD_SIZES:
        return None
    return (f"{where}: attention head size {head} is not one vLLM's CPU engine serves "
            f"({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); {fix}, or use rollout.engine=hf")
