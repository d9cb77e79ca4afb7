"""bakeoff: qualify LLM inference backends for a model, with evidence, and measure them."""

__version__ = "0.1.0"
