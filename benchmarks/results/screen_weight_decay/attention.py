"""Where does the answer position attend, per layer/head, for birth_year and occupation episodes?"""
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from async_agent_rl.config import load_config
from async_agent_rl.data.search_r1 import read_qa_files
from warm_start.reading import episode_reading_demos
from warm_start.demos import value_tokens

cfg_path, model_dir, *ov = sys.argv[1:]
cfg = load_config(cfg_path, ov)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
ex, _ = read_qa_files(cfg.data.train_files, cfg.data.on_bad_row)
demos = [d for d in episode_reading_demos(cfg, tok, ex, cfg.sft.seed) if d.meta.extra["relation"] in ("birth_year", "occupation")]
for rel in ("occupation", "birth_year"):
    ds = [d for d in demos if d.meta.extra["relation"] == rel]
    stats = {}
    right = [0, 0, 0, 0, 0]; n = 0
    for d in ds:
        ids = list(d.prompt_ids) + list(d.response_ids)
        at = [len(d.prompt_ids) + k for k in value_tokens(tok, d, d.turns[-1], d.meta.extra["answer"])]
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model(input_ids=x, output_attentions=True)
        pred = out.logits[0].argmax(-1)
        for j, p in enumerate(at):
            right[j] += int(pred[p - 1] == ids[p])
        n += 1
        # source positions of the answer value's tokens inside the observation (exact token match, before the answer)
        vals = [ids[p] for p in at]
        for j, p in enumerate(at):
            q = p - 1
            src = [i for i in range(len(d.prompt_ids), at[0] - 8) if ids[i] == vals[j] and (j == 0 or ids[i - 1] == vals[j - 1])]
            for L, A in enumerate(out.attentions):
                for h in range(A.shape[1]):
                    mass = float(A[0, h, q, src].sum()) if src else 0.0
                    stats.setdefault((j, L, h), []).append(mass)
    print(f"== {rel}: {n} episodes; token right per position: {[round(r / n, 2) for r in right[:len(at)]]}")
    for j in range(len(at)):
        row = " ".join(f"L{L}h{h}:{sum(v)/len(v):.2f}" for (jj, L, h), v in sorted(stats.items()) if jj == j)
        print(f"  answer token {j}: attention on its source in the observation  {row}")
