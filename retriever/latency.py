"""Tool-latency models: how long a search tool takes to answer, drawn per query from a seeded distribution.

One table (``LATENCY_MODELS``) for the retrieval server (``retriever.latency``, ``retriever serve|proxy --latency``)
and the rollout benchmark (``benchmarks/rollout_bench.py --latency``):

- ``none``: no added latency (the default).
- ``local``: log-normal, median 20 ms, sigma 0.5, capped at 0.5 s (a dense retriever on a GPU next door).
- ``web``: log-normal, median 0.5 s, sigma 0.8 (p99 about 3.2 s), capped at 8 s, and 2% of calls that hang (a web
  search API: most calls a few hundred ms, a tail to seconds, now and then one that never answers in time).

A draw is a number of seconds; a hang is ``math.inf`` ("until the caller gives up"): the server holds such a call
for ``retriever.latency_hang_s`` or until its client disconnects, whichever comes first. Draws come from one
``random.Random(seed)`` in call order, so the same seed gives the same sequence; a model without hangs makes exactly
one log-normal draw per call (the benchmark's sequences from before this table are unchanged for ``local``).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LatencyModel:
    """Log-normal latency with ``median_s`` and log-sigma ``sigma``, capped at ``cap_s``; a share ``hang_fraction``
    of calls hangs (``math.inf``). ``median_s == 0`` means no latency at all."""

    name: str
    median_s: float = 0.0
    sigma: float = 0.0
    cap_s: float = 0.0
    hang_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0 or self.cap_s < 0 or not 0.0 <= self.hang_fraction < 1.0:
            raise ValueError(f"latency model {self.name!r}: parameters must be >= 0 and hang_fraction < 1")

    @property
    def is_none(self) -> bool:
        return self.median_s == 0 and self.hang_fraction == 0

    def draw(self, rng: random.Random) -> float:
        """One call's latency in seconds (``math.inf``: the call hangs)."""
        if self.is_none:
            return 0.0
        if self.hang_fraction > 0 and rng.random() < self.hang_fraction:
            return math.inf
        if self.median_s == 0:
            return 0.0
        return min(self.cap_s, rng.lognormvariate(math.log(self.median_s), self.sigma))

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the latency of calls that do not hang (the log-normal, capped)."""
        if self.median_s == 0:
            return 0.0
        return min(self.cap_s, self.median_s * math.exp(self.sigma * _normal_quantile(q)))

    def params(self) -> dict:
        return asdict(self)


def _normal_quantile(q: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(q)


LATENCY_MODELS: dict[str, LatencyModel] = {
    "none": LatencyModel("none"),
    "local": LatencyModel("local", median_s=0.02, sigma=0.5, cap_s=0.5),
    "web": LatencyModel("web", median_s=0.5, sigma=0.8, cap_s=8.0, hang_fraction=0.02),
}


def latency_model(name: str) -> LatencyModel:
    """The model called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return LATENCY_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown latency model {name!r}; known: {', '.join(LATENCY_MODELS)}") from None


class LatencySampler:
    """Seeded draws of one model, in call order: ``sample()`` -> seconds (``math.inf`` for a hang)."""

    def __init__(self, model: LatencyModel | str, seed: int = 0):
        self.model = latency_model(model) if isinstance(model, str) else model
        self.rng = random.Random(seed)

    def sample(self) -> float:
        return self.model.draw(self.rng)

    def sample_many(self, n: int) -> list[float]:
        return [self.sample() for _ in range(n)]
