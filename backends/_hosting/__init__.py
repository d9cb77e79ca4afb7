"""Code that runs inside engine environments: the worker HTTP server and the engine-process pipe."""
