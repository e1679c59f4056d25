"""The search tool: a Search-R1-compatible retrieval server and its backends. An episode renders the hits it gets
with ``async_agent_rl.render``."""
