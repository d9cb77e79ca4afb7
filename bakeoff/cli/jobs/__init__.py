"""bakeoff's own work as Hugging Face Jobs: render a uv script, submit it, follow it, fetch its output.

Modules: :mod:`~bakeoff.cli.jobs.specs` (task, request, record), :mod:`~bakeoff.cli.jobs.render` (the
PEP 723 uv script), :mod:`~bakeoff.cli.jobs.runtime` (what the script runs), :mod:`~bakeoff.cli.jobs.submit`
(``huggingface_hub`` calls), :mod:`~bakeoff.cli.jobs.cli` (``bakeoff jobs ...``). See docs/jobs.md.
"""
