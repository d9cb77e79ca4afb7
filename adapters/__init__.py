"""Adapters: build/export/load steps that turn a source checkpoint into what an engine loads.

Each adapter is a package (``ort_genai_export``, ...) that runs its tool in the tool's own
environment (``bakeoff.host.envs``) and returns a pydantic result, or raises
``bakeoff.api.errors.EngineFailure`` with a failure class and evidence.
"""
