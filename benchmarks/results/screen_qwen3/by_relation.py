"""Held-out EM after RL by relation for a run folder (the `bench learning` report's table, for runs made by
`async-agent-rl train` outside a study). Usage: python benchmarks/results/screen_qwen3/by_relation.py RUN_DIR"""
import json
import sys
from pathlib import Path

from driver.bench.learning import relation_numbers

d = Path(sys.argv[1])
rows = relation_numbers(d, [json.loads(line) for line in open(d / "eval.jsonl")])
print(", ".join(f"{k} {v['em_rl']:.2f} (n={v['n']})" for k, v in rows.items() if v["n"] >= 20))
