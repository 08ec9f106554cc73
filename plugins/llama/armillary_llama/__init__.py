"""armillary-llama: Llama-architecture models for armillary, from safetensors checkpoints or GGUF files."""
