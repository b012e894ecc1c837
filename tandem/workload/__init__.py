"""Workloads: sessions and their JSONL format, public traces, synthetic generators, arrival processes."""
