"""``python -m retriever serve|index ...``: the retriever commands without the project CLI."""

from retriever.cli import main

raise SystemExit(main())
