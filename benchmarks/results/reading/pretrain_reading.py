"""pretrain only, with the per-relation reading check every READ_EVERY steps (env, default 250) and at the end:
python pretrain_reading.py CONFIG OUT overrides..."""
import json, os, sys, time, logging
from pathlib import Path
import torch
from async_agent_rl.config import load_config
from warm_start.sft import _start, _pretrain_texts, pretrain_on_texts, PRETRAIN_SEQ_LEN, ThreadTuner
from warm_start.reading import reading_items, reading_scores, scores_line
logging.basicConfig(level=logging.INFO)
cfg = load_config(sys.argv[1], sys.argv[3:])
s = cfg.sft
every = int(os.environ.get("READ_EVERY", "250"))
out, tok, model, pad = _start(cfg.model.path, sys.argv[2], s.seed)
items = reading_items(Path(cfg.data.world_dir) / "world.json", s.seed)
curve = []
def on_step(m):
    if m["step"] % every == 0 or m["step"] == s.pretrain_steps:
        r = reading_scores(model, tok, items)
        model.train()
        curve.append({"step": m["step"], "loss": m["loss"], "reading": r})
        print(f"step {m['step']}: {scores_line(r)}", flush=True)
t = time.time()
texts = _pretrain_texts(cfg, s.pretrain_steps, s.batch_size, PRETRAIN_SEQ_LEN, tok)
losses = pretrain_on_texts(model, tok, texts, s.pretrain_steps, s.batch_size, s.lr, s.warmup_steps, s.seed,
                           PRETRAIN_SEQ_LEN, on_step=on_step, threads=ThreadTuner.for_config(s.threads),
                           packing=s.pretrain_packing, answer_weight=s.pretrain_answer_weight)
json.dump({"argv": sys.argv[1:], "seconds": time.time() - t, "curve": curve}, open(f"{sys.argv[2]}/reading.json", "w"), indent=1)
