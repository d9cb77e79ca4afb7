"""vLLM: its own OpenAI-compatible server in its own environment."""
