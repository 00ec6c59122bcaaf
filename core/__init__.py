"""The decoding engine: vanilla and EAGLE speculative decoding. Knows nothing of the UI."""
