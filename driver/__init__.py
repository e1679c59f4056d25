"""The driver: the command line, the training loop that wires the Ray actors together, benchmarks and plots.

The top layer: it may import every other package; none of them imports it."""
