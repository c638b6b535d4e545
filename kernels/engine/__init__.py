"""One engine as a rank: the torch.distributed world (runtime), %%px cells, the driver watchdog, and the five collectives run by hand."""
