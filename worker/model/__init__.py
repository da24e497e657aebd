"""The model: config, the Llama decoder, attention, KV cache, loading, quantization, tokenizer, and the
step built from it (-O presets, kernel tuning, torch.compile and its cache)."""
