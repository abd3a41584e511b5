"""Using a trained model: ``generate``, ``eval`` (loss and perplexity, or lm-evaluation-harness tasks)."""
