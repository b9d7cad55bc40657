"""Training harness: the GPT model family and its data."""
