"""The offline batch edge: `python -m app.batch` classifies files through the serving core, with no HTTP."""
