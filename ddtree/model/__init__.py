"""Model execution: loading, the target's forward and attention over the paged KV cache, capture,
checkpoints, quantization and tensor parallelism."""
