"""Model folders shared by the gateway and the workers: locating the embedded default
model and converting a GGUF into a cached Hugging Face folder (no torch here)."""
