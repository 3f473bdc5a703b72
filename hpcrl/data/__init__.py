"""Datasets: prompt/answer rows from files, and the synthetic addition task."""

from hpcrl.data.rows import BadRowError, Row, load_rows

__all__ = ["BadRowError", "Row", "load_rows"]
