"""Measured beside predicted: memory and communication, pipeline timelines, host traffic, TP placement, and collective bandwidth."""
