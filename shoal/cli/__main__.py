"""`python -m shoal.cli`: the same as the `shoal` console script."""

from shoal.cli import app

app(prog_name="shoal")
