"""DFlash: block-diffusion speculative decoding."""
