"""``--export report.html``: the explorer's page as one self-contained file.

The file holds the page, its script and style, the chart library and the run's data (summary, every
step's metrics, the evaluations, the events, and the first ``groups_per_kind`` groups of each spool kind
with their tokens), so it opens anywhere without a server or network: attach it to a paper or an issue.
The page finds the data in ``window.HPCRL_EXPORT`` and reads nothing else.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpcrl.explore.reader import KINDS, GroupQuery, RunView
from hpcrl.explore.server import static_file

__all__ = ["export_html"]


def _script(text: str) -> str:
    return text.replace("</", "<\\/")  # nothing inside a <script> can close it


def export_html(view: RunView, out: str | Path, groups_per_kind: int = 50) -> Path:
    groups: dict[str, list[dict]] = {}
    details: dict[str, dict] = {}
    for kind in KINDS:
        page = view.groups(GroupQuery(kind=kind, limit=max(1, min(groups_per_kind, 500))))["groups"]
        rows = []
        for g in page[:groups_per_kind]:
            try:
                detail = view.group(g["path"])
            except FileNotFoundError:  # a live run moved it (claimed, trained) since the listing
                continue
            details[g["path"]] = detail
            samples = detail.get("samples") or []
            rows.append({**g, "reason": (detail.get("reason") or {}).get("reason", ""),
                         "reward_mean": sum(s["reward"] for s in samples) / len(samples) if samples else None})
        groups[kind] = rows
    data = {"summary": view.summary(), "curves": view.curves(0),
            "events": {"events": view.events(), "components": view.components()},
            "groups": groups, "details": details, "exported": time.strftime("%Y-%m-%d %H:%M")}
    page = static_file("index.html").decode()
    css = static_file("explore.css").decode()
    # every "<" of the data escaped: no prompt or reason text can end the script or open a comment in it
    embedded = json.dumps(data).replace("<", "\\u003c")
    head = (f"<style>\n{css}</style>\n<script>window.HPCRL_EXPORT = {embedded};</script>\n"
            f"<script>{_script(static_file('plotly.min.js').decode())}</script>\n")
    page = page.replace('<link rel="stylesheet" href="static/explore.css">', "")
    page = page.replace('<script src="static/plotly.min.js"></script>', head)
    page = page.replace('<script src="static/explore.js" defer></script>', "")
    page = page.replace("</body>", f"<script>{_script(static_file('explore.js').decode())}</script>\n</body>")
    out = Path(out)
    out.write_text(page, encoding="utf-8")
    return out
