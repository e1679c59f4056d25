"""one more demonstrations stage (names frozen, no pretraining) from a finished warm start:
python continue_demos.py CONFIG FROM_DIR OUT overrides..."""
import json, sys, logging
from async_agent_rl.config import load_config
from warm_start.sft import run_sft
logging.basicConfig(level=logging.INFO)
cfg = load_config(sys.argv[1], sys.argv[4:])
s = run_sft(cfg, sys.argv[2], sys.argv[3], pretrain_steps=0, freeze_entity_embeddings=True, progress=True)
print(json.dumps({k: s[k] for k in ("final_loss", "steps")}))
