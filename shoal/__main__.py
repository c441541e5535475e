"""`python -m shoal`: the same as the `shoal` console script (and `python -m shoal.cli`)."""

from shoal.cli import app

app(prog_name="shoal")
