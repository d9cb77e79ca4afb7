"""The ``openai`` backend: attach to any running OpenAI/Anthropic-compatible server."""
