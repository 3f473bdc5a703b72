"""``python -m hpcrl status|cancel|scale <run_dir>``: look at a run, stop it cleanly, or set its rollout count.

See :mod:`hpcrl.launch.control` (status, cancel) and :mod:`hpcrl.launch.fleet`
(scale). A run is started with ``python -m hpcrl.submit``. Exit codes: 0
done, 1 the cancel left something running, 2 not a run directory or a
request the run cannot take.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hpcrl.plugins import defer_plugins
from hpcrl.config import ConfigError
from hpcrl.launch.control import cancel, format_status, run_status, scale
from hpcrl.runtime.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    defer_plugins()  # reads a run whose config was checked at submit: plugins need not load here
    parser = argparse.ArgumentParser(prog="python -m hpcrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="the run's state, components, progress and checkpoint")
    st.add_argument("run_dir", type=Path)
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    st.add_argument("--watch", type=float, metavar="S", help="redraw every S seconds (Ctrl-C ends)")
    ca = sub.add_parser("cancel", help="stop every component cleanly (checkpoint first); resumable")
    ca.add_argument("run_dir", type=Path)
    ca.add_argument("--timeout", type=float, metavar="S",
                    help="give up waiting after S seconds (default: launch.preempt_grace_s + 60)")
    sc = sub.add_parser("scale", help="set the number of rollout replicas of a running run (drains or starts them)")
    sc.add_argument("run_dir", type=Path)
    sc.add_argument("replicas", type=int, help="rollout replicas wanted (0 pauses generation; the trainer waits)")
    args = parser.parse_args(argv)
    setup_logging("control")
    try:
        if args.command == "cancel":
            return 0 if cancel(args.run_dir, args.timeout) else 1
        if args.command == "scale":
            print(scale(args.run_dir, args.replicas), file=sys.stderr)
            return 0
        while True:
            st = run_status(args.run_dir)
            text = json.dumps(st, indent=1) if args.json else format_status(st)
            if args.watch:
                print("\033[2J\033[H" + time.strftime("%H:%M:%S"), flush=True)
            print(text, flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
