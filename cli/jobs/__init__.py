"""bakeoff's own work as Hugging Face Jobs: render a uv script, submit it, follow it, fetch its output.

Modules: :mod:`~cli.jobs.specs` (task, request, record), :mod:`~cli.jobs.render` (the
PEP 723 uv script), :mod:`~cli.jobs.runtime` (what the script runs), :mod:`~cli.jobs.submit`
(``huggingface_hub`` calls), :mod:`~cli.jobs.cli` (``bakeoff jobs ...``). See docs/jobs.md.
"""
