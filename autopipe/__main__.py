"""``python -m autopipe ...``: the CLI where the ``autopipe`` script is not on PATH (a venv not
activated, a read-only image whose bin folder is elsewhere)."""

from .cli import app

app(prog_name="autopipe")
