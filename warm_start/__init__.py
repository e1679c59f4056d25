"""The supervised warm start before RL: the scripted expert's demonstrations (``demos``, run through the real
episode loop with real retrieval) and the SFT that imitates them (``sft``). Plain torch, no Ray, no DeepSpeed."""
