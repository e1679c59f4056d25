"""Batch-synchronous rollout, as in Search-R1's and verl's generation loops: a wave of episodes generates turn by
turn in lockstep (every active episode starts its turn together; the wave waits for the longest generation and the
slowest search), and the next wave starts only when the whole wave is done.

This is the synchronous baseline of the benchmarks and ``rollout.mode: sync``; the system itself runs every episode
as its own task with no barrier (``actors.rollout_worker``). The episode code is the same in both: only the engine
handed to ``EpisodeRunner`` differs.
"""

from __future__ import annotations

import asyncio
from typing import Any


class TurnBarrier:
    """A reusable barrier whose party shrinks as episodes finish (``leave``)."""

    def __init__(self, parties: int):
        self.parties = parties
        self.waiting = 0
        self.generation = 0
        self.cond = asyncio.Condition()

    async def wait(self) -> None:
        async with self.cond:
            gen = self.generation
            self.waiting += 1
            if self.waiting >= self.parties:
                self._release()
            else:
                await self.cond.wait_for(lambda: self.generation != gen)

    async def leave(self) -> None:
        async with self.cond:
            self.parties -= 1
            if self.parties and self.waiting >= self.parties:
                self._release()

    def _release(self) -> None:
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()


class LockstepEngine:
    """Wraps an engine so that the episodes sharing ``barrier`` generate each turn together."""

    def __init__(self, engine: Any, barrier: TurnBarrier):
        self.engine, self.barrier = engine, barrier

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, req: Any) -> Any:
        await self.barrier.wait()  # every active episode has finished its previous search
        out = await self.engine.generate(req)
        await self.barrier.wait()  # the whole wave waits for the longest generation
        return out
