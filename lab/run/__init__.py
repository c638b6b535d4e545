"""Training on a pool: the Parallel layout, Experiment and Training, their results, handles, views and logs, faults on purpose, controls, schedule comparisons and checkpoints."""
