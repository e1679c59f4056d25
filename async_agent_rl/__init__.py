"""The Ray-free core: records, config, algorithms, staleness math, rewards, prompts, data."""

import os

# MKL's strict conditional numerical reproducibility: its matrix products then give the same bits at any thread
# count on a given processor (without it, a weight gradient's product differs between 1 and 2 threads on AVX-512
# processors). The warm start picks its thread count from its own step times, so without this a loaded machine
# could compute another warm start than an idle one. MKL reads the variable once, at the first matrix product: every
# module of the project imports this package before it computes anything. A value already set by the user is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
