"""``python -m autopipe ...``: the CLI where the ``autopipe`` script is not on PATH (a venv not
activated, a read-only image whose bin folder is elsewhere)."""

from .cli import app

if __name__ == "__main__":  # importing it (doctest collection) runs nothing
    app(prog_name="autopipe")
