"""Operator tools beside the router: importable packages (``tools.deployment``,
``tools.measurement``, ``tools.observability``, ``tools.interop``) whose entry scripts also run
by path (``python tools/measurement/load_trial.py ...``) from a checkout.

Run by path, a script's own folder is on ``sys.path`` and the repository root is not, so
``tools.measurement`` would not import: each entry script that imports its siblings starts with
the same two lines, which put the root on ``sys.path`` only when it runs as a script
(``__package__`` empty). Imported as a module (tests, ``python -m tools.measurement.load_trial``)
they do nothing; the imports themselves are ordinary package imports.
"""
