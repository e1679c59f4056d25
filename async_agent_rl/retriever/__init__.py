"""The search tool: a Search-R1-compatible retrieval server, its backends, and Search-R1's observation rendering."""
