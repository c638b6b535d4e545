"""Probes that measure a rank: memory and its timeline, activation parts, collective bandwidth, pipeline traces, synthetic stage costs, and dry runs on the meta device."""
