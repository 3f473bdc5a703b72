"""Evaluation of a policy: greedy accuracy on held-out rows."""

from hpcrl.eval.accuracy import EvalResult, greedy_accuracy

__all__ = ["EvalResult", "greedy_accuracy"]
