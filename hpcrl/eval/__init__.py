"""Evaluation of a policy: greedy accuracy on held-out rows."""

from hpcrl._lazy import lazy_namespace

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "EvalResult": "hpcrl.eval.accuracy",
    "greedy_accuracy": "hpcrl.eval.accuracy",
}
lazy_namespace(__name__, _LAZY)
