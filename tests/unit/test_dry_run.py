"""``train --dry-run``'s report (driver/check.py), built in-process: the shipped GPU config on this CPU machine and
on one with its GPUs, the quickstart config, and the learner's memory arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from async_agent_rl.config import load_config
from driver import check
from driver.check import Gpu, dry_run

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIG = REPO / "configs" / "search_r1_nq_gpu.yaml"
QUICKSTART = REPO / "configs" / "quickstart.yaml"
H100 = Gpu("H100", 80 << 30)


def test_gpu_config_on_a_machine_without_its_files_or_gpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's relative paths lead nowhere here
    # no retriever.url: probing one is the integration tier's (tests/integration/test_cli_dry_run.py)
    cfg = load_config(GPU_CONFIG, ["retriever.url=null"])
    report = dry_run(cfg, gpus=[])
    problems = "\n".join(report.problems)
    for expected in ("model.path models/Qwen2.5-3B-Instruct: no model folder", "data.train_files", "data.test_files",
                     "data.corpus_file", "needs 8 GPU(s) and this machine has 0"):
        assert expected in problems
    lines = "\n".join(report.lines)
    assert "4 actor(s) x 1 GPU; each vLLM engine takes 80% of its GPU's memory" in lines
    assert "4 rank(s) x 1 GPU, ZeRO-3, bfloat16" in lines
    assert "engine core in its own process" in lines or "vLLM is not installed" in problems
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_gpu_config_with_its_files_and_gpus_is_fine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(check, "installed_vllm", lambda: ("vllm", "0.11.0"))
    model = tmp_path / "models" / "Qwen2.5-3B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1000, 1000), "b": torch.zeros(1000)}, str(model / "model.safetensors"))
    for name in ("data/nq_search/train.parquet", "data/nq_search/test.parquet", "data/wiki-18.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    cfg = load_config(GPU_CONFIG, ["retriever.url=null"])  # the run starts its own BM25 retriever
    report = dry_run(cfg, gpus=[H100] * 8)
    assert report.problems == []
    lines = "\n".join(report.lines)
    assert "(1.0 M parameters)" in lines and "(64 GiB)" in lines and "this machine has 8: H100 80 GiB" in lines
    # the same learner on GPUs of 4 MB: its model states do not fit
    small = dry_run(cfg, gpus=[Gpu("tiny", 4 << 20)] * 8)
    assert any("model states" in p and "exceed" in p for p in small.problems)


def test_a_damaged_model_or_a_folder_for_a_data_file_is_a_problem(tmp_path, monkeypatch):
    """Until 54b4bb0 (2026-11-26), a truncated ``model.safetensors`` made the dry run fail inside safetensors
    (unexpected error) and the run's engine fail with a traceback; a folder given as a data file counted as a missing
    file."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "models" / "Qwen2.5-3B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    save_file({"w": torch.zeros(100, 100)}, str(model / "model.safetensors"))
    intact = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(intact[:-100])
    (tmp_path / "data" / "nq_search" / "train.parquet").mkdir(parents=True)
    report = dry_run(load_config(GPU_CONFIG, ["retriever.url=null"]), gpus=[H100] * 8)
    problems = "\n".join(report.problems)
    assert (f"model.path models/Qwen2.5-3B-Instruct/model.safetensors: truncated safetensors file: "
            f"{len(intact) - 100} bytes, its header describes {len(intact)}") in problems
    assert "data.train_files data/nq_search/train.parquet: a folder, not a file" in problems


def test_learner_model_states_follow_zero_sharding():
    cfg = load_config(GPU_CONFIG)  # bfloat16, 4 ranks, ZeRO-3, reference model with kl_coef > 0
    params = 1_000_000
    # weights 2, gradients 2, Adam + fp32 master 12 bytes per parameter, all over 4 ranks; the reference in full
    assert check._learner_state_bytes(cfg, params) == (2 + 2 + 12) * params / 4 + 2 * params
    stage0 = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"zero_stage": 0})})
    assert check._learner_state_bytes(stage0, params) == 16 * params + 2 * params


def test_quickstart_config_needs_nothing_it_does_not_build(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = dry_run(load_config(QUICKSTART), gpus=[])
    assert report.problems == [] or report.problems == ["vLLM is not installed (rollout.engine: vllm); "
                                                        "bash scripts/setup.sh installs it"]
    lines = "\n".join(report.lines)
    assert "the run builds a tiny one" in lines and "the run generates the world" in lines
    assert "started by the run: bm25" in lines and "asks Ray for 0 GPU(s)" in lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override", ["retriever.faiss_index=missing.index", "retriever.dense_model=no_model"])
def test_dense_retriever_paths_are_checked(tmp_path, monkeypatch, override):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "encoder").mkdir()
    (tmp_path / "e5_Flat.index").write_bytes(b"")
    paths = ["retriever.backend=dense", "retriever.dense_model=encoder", "retriever.faiss_index=e5_Flat.index"]
    report = dry_run(load_config(QUICKSTART, [*paths, override]), gpus=[])
    assert any(("FAISS index file missing.index" in p) or ("encoder folder no_model" in p) for p in report.problems)
