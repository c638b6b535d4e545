"""A training run on the ranks: the entry point, building the layout, the loop and its hooks, data, optimizer, the one-process reference, checkpoint cadence, and the measured run."""
