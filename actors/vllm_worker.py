"""Code that runs inside vLLM's workers: the engine's ``worker_extension_cls``.

vLLM mixes ``PolicyReloadExtension`` into each of its workers, and ``VLLMEngine.update_weights`` calls its method
by name through ``collective_rpc`` (a name, never pickled code).

Why not vLLM's own ``reload_weights`` alone: it reloads every layer whose weights are in the file, but a tied output
head (``lm_head`` sharing the input embedding, as in small Qwen models) has no weights of its own in the file. On
the CPU build each linear layer computes with a copy of its weight packed for the CPU kernels when it was loaded,
so after a reload the tied head still computed the logits with the *first* weights it was loaded with: the embedding
and every other layer followed the learner, the logits did not. Measured on the quickstart's model after 24 RL steps:
the head's output was off by 0.48 against the published weights (every other layer: 0.0), and greedy output was the
warm start's with garbled words. ``reload_policy_weights`` re-ties the head to the reloaded embedding and re-packs
every CPU layer that keeps its weight beside the packed copy, so the engine computes with exactly the published
weights (tests/integration/test_weight_publish.py compares its log-probs with transformers).

The collective path (``weight_sync.method: collective``) comes through here too: ``join_weight_group`` makes this
worker a member of the learner's broadcast group (``async_agent_rl.weight_group``), and ``receive_policy_weights``
receives every tensor of a publish, then reloads them in place exactly as a file would be (same checks downstream,
same re-tie and re-pack).
"""

from __future__ import annotations

from typing import Any, Sequence


class PolicyReloadExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``self.model_runner`` holds the model)."""

    def reload_policy_weights(self, weights_path: str) -> int:
        """Reload the model's weights from the safetensors folder ``weights_path``, then bring tied heads and
        CPU-packed kernels up to date. Returns the number of layers re-packed."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_path=weights_path)
        return refresh_derived_weights(runner.get_model())

    def join_weight_group(self, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float,
                          generation: int) -> int:
        """Join the learner's broadcast group as rank ``rank_offset`` + this worker's rank in its engine; returns
        that rank. A group joined before (a group made again after a restart) is left first."""
        from async_agent_rl.weight_group import WeightGroup

        self.leave_weight_group()
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._weight_group = WeightGroup(port, rank, world_size, backend, timeout_s, generation=generation)
        return rank

    def leave_weight_group(self) -> None:
        group = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
            self._weight_group = None

    def receive_policy_weights(self, specs: Sequence[tuple[str, str, Sequence[int]]]) -> int:
        """Receive one publish (every tensor of ``specs``, in order), then reload them in place; returns the number
        of layers re-packed. Everything is received before loading, so a loader error never leaves the sender
        blocked halfway."""
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("receive_policy_weights before join_weight_group")
        received = list(group.receive(specs))
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=iter(received))
        return refresh_derived_weights(runner.get_model())


def refresh_derived_weights(model: Any) -> int:
    """Re-tie a tied output head to the input embedding and re-pack the CPU kernels of layers that keep their
    weight (vLLM's CPU build packs a copy at load time; layers that drop their weight are re-packed by the reload
    itself). Returns the number of layers re-packed (0 on GPU, where kernels read the weight directly)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and head is not None and embed is not None and head.weight is not embed.weight:
        head.weight = embed.weight
    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.dim() == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked
