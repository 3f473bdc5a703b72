"""Datasets: prompt/answer rows from files, and the synthetic arithmetic (addition, multiplication) and reverse tasks."""

from hpcrl._lazy import lazy_namespace

# name -> defining module, imported on first use: importing a package's config (as the root
# config does) must not pull in torch
_LAZY = {
    "BadRowError": "hpcrl.data.rows",
    "Row": "hpcrl.data.rows",
    "load_rows": "hpcrl.data.rows",
}
lazy_namespace(__name__, _LAZY)
