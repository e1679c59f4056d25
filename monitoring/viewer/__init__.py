"""The run viewer: ``async-agent-rl view RUN_DIR`` serves a page on 127.0.0.1 with a run's learning curves,
throughput, staleness, tool latency and a browser of the training episodes kept in ``RUN_DIR/episodes/``
(``monitoring.episode_sample``). ``runs`` reads the run folder, ``server`` serves it; the page (``static/``: plain
HTML, SVG drawn by vanilla JavaScript) ships in the package and loads nothing from elsewhere. docs/VIEWER.md."""
