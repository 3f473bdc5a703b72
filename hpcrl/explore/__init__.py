"""The run explorer: a local web page for a run's curves, staleness, timeline and trajectories.

``python -m hpcrl.explore <run_dir>`` (docs/explore.md). :mod:`~hpcrl.explore.reader` reads the run
directory read-only, :mod:`~hpcrl.explore.server` serves the page and its JSON API,
:mod:`~hpcrl.explore.export` writes the page as one self-contained file.
"""
