"""Distributed checkpoints: sharded save and load with torch.distributed.checkpoint, their files and meta, and pinned staging buffers."""
