"""Loading base models, quantization, draft heads and their checkpoint formats."""
