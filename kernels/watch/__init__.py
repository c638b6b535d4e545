"""Watching a rank from outside its work: the collective log and flight recorder, live progress and the stop flag, wait clocks, communication metering, injected faults and stack reports."""
