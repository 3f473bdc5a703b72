"""``python -m hpcrl.explore <run_dir> [--port N] [--host H] [--export report.html]``: look at a run in a browser.

Serves the run explorer (:mod:`hpcrl.explore.server`) until Ctrl-C, on
127.0.0.1 by default, behind an access token (given with --token or
$HPCRL_EXPLORE_TOKEN, else generated; --no-token on loopback only), and
prints the URL that carries it. ``--export FILE`` writes one self-contained HTML file and
exits. Reads the run directory only: it works on a live run and on a
finished one. Exit codes: 0 done, 2 not a run directory, a bad option, or no ``plotly``
(the ``explore`` extra: the page draws with it; refused before anything is served).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpcrl.explore.reader import RunView
from hpcrl.explore.server import make_server, plotly_js, url_of
from hpcrl.runtime.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.explore", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8787, help="port (0: any free one; default 8787)")
    parser.add_argument("--token", default=os.environ.get("HPCRL_EXPLORE_TOKEN"),
                        help="access token (default $HPCRL_EXPLORE_TOKEN, else generated and printed in the URL)")
    parser.add_argument("--no-token", action="store_true",
                        help="no token, on loopback only (anyone logged in to this host can then read the run)")
    parser.add_argument("--export", type=Path, metavar="FILE", help="write a self-contained HTML report and exit")
    parser.add_argument("--export-groups", type=int, default=50, metavar="N",
                        help="groups of each spool kind (trained, dropped, ...) in the export (default 50)")
    args = parser.parse_args(argv)
    setup_logging("explore")
    try:  # the page draws nothing without it: refuse before serving a page that would open empty
        plotly_js()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        view = RunView(args.run_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.export:
        from hpcrl.explore.export import export_html
        out = export_html(view, args.export, args.export_groups)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
        return 0
    try:
        srv = make_server(view, args.host, args.port, "" if args.no_token else args.token)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    print(f"hpcrl explorer for {view.root}: {url_of(srv)}  (Ctrl-C ends)", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
