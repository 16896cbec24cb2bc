"""Scheduler-side benchmarks: the connector's hooks driven as vLLM's scheduler calls them, no engine."""
