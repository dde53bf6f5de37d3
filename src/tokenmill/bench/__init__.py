"""Benchmarks: offline throughput against Hugging Face transformers baselines, and the roofline floor."""

# `bench throughput --backend`'s choices, each run by `throughput.run_backend` (here, not there: `bench
# serve`, a client, builds the same parser without importing torch)
BACKENDS = ("tokenmill", "hf-static", "hf-cb")
