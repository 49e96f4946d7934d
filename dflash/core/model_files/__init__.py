"""A model directory's files, read and checked without torch or mlx: the DFlash drafter checkpoint (config.json +
safetensors), a target's config.json (RoPE in both spellings) and its tokenizer with the chat helpers. Backends,
converters and applications load through them; the speculative loop never does."""
