"""``python -m async_agent_rl.retriever serve|index ...``: the retriever commands without the project CLI."""

from async_agent_rl.retriever.cli import main

raise SystemExit(main())
