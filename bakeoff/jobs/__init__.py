"""bakeoff's own work as Hugging Face Jobs: render a uv script, submit it, follow it, fetch its output.

Modules: :mod:`~bakeoff.jobs.specs` (task, request, record), :mod:`~bakeoff.jobs.render` (the
PEP 723 uv script), :mod:`~bakeoff.jobs.runtime` (what the script runs), :mod:`~bakeoff.jobs.submit`
(``huggingface_hub`` calls), :mod:`~bakeoff.jobs.cli` (``bakeoff jobs ...``). See docs/jobs.md.
"""
