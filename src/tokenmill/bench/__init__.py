"""Benchmarks: offline throughput against Hugging Face transformers baselines, and the roofline floor."""
