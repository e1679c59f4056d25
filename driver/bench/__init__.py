"""``async-agent-rl bench``: short trainings side by side on one config, and a report built from their run folders.

    async-agent-rl bench staleness --config configs/quickstart.yaml --etas 0,1,2,4,8 [--steps N] [overrides]
    async-agent-rl bench ablations --config configs/quickstart.yaml [--studies masking,estimator,topk,group_size]
    async-agent-rl bench sync      --config configs/quickstart.yaml      # asynchronous against synchronous RL
    async-agent-rl bench learning  --config configs/quickstart.yaml --seeds 0,1,2   # RL against more SFT, per world

Every arm is a real ``async-agent-rl train`` in a child process (its own local Ray), run one after the other so
they do not share the machine, with the arm's overrides on top of the config and the command line's. Arms start
from one shared SFT warm start, made once by ``async-agent-rl sft``, except arms whose prompt format differs (the
chat-template study), which get their own. Warm starts live in ``OUT/../warm_start/<hash of their inputs>``, so
the staleness, ablation and sync benches of one config share one. Every number in the
report is read back from the run folders' own files (``metrics.jsonl``, ``eval.jsonl``, ``summary.json``,
``config.yaml``); an arm whose run folder already holds a finished run with the same resolved config is not run
again (``--force`` reruns), so a report can be extended study by study.

Output, in ``--out`` (default ``runs/bench/<kind>``): ``report.md`` (the table, the plots, the commands),
``report.json`` (the same numbers), ``<study>.png`` (held-out exact match, reward, response length and searches
per episode over training, one line per arm), one run folder and one log per arm.

``bench learning`` repeats one RL arm per seed, each on a world of its own (``OUT/worlds/seed_<s>``: world, tiny
model, warm start and training seeds all from the seed), and gives each an SFT-only arm: the same warm start
trained further by SFT for RL's training time (``bench continue-sft``, ``warm_start.sft.continue_sft``), then
``async-agent-rl eval`` on the same held-out questions. Its report has one table per kind of question with the mean
and standard error over seeds, ``learning_curves.png`` and ``learning_bars.png``.

Modules, by what a newcomer looks for:

- ``arms``: the studies' arms (config overrides) and ``ArmRun``;
- ``runner``: a warm start and the arms, each a ``train`` child process; finished arms reused;
- ``results``: an arm's numbers from its run folder, time to accuracy, mean and standard error;
- ``reports``, ``plots``: the one-seed report and the plots;
- ``seeds``: ``--seeds``, every arm per seed and the report over seeds (the staleness recommendation, the async/sync
  ratio);
- ``learning``: ``bench learning`` and ``bench continue-sft``;
- ``cli``: the argument parser and the commands.

Torch (``warm_start.sft``) and matplotlib are imported inside the functions that use them: the CLI imports
``cli`` for every command, ``config show`` included.
"""
