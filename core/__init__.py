"""armillary: an LLM inference server for hybrid open models, with architectures as plugins."""
