"""Models: resolving ``--model`` (a folder, a hub id, ``fixture:NAME``) and building the fixtures."""
