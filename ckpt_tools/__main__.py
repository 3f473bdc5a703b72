"""``python -m ckpt_tools {inspect,verify,to-hf,prune}``: look after checkpoints and weights.

- ``inspect PATH``: tensors, shapes, dtypes and metadata of a trainer checkpoint
  (``<run_dir>/ckpt/step_N``, or a run dir / ckpt root for the newest) or of
  safetensors weights (``<run_dir>/weights/vN``).
- ``verify PATH``: size and sha256 of every file of one checkpoint, or of all
  under a ``ckpt/`` root or a run directory; exit 1 if any is damaged.
- ``to-hf CKPT OUT [--base-model DIR] [--force]``: a HuggingFace folder
  transformers loads. A checkpoint ``verify`` rejects is refused (exit 1)
  unless ``--force``, which converts it with a warning.
- ``prune ROOT --keep-last K [--keep-every M] [--force]``: apply a retention
  policy to a ``ckpt/`` root or a run directory. The newest checkpoint that
  verifies is always kept, and ``--keep-last 0`` needs ``--force``.

Exit codes: 0 done, 1 damaged or nothing to act on, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import safe_open

from ckpt_tools import dcp_tools
from hpcrl.ckpt import store


def safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"error: no checkpoint or .safetensors files in {path}")
    return files


def inspect_safetensors(path: Path) -> dict:
    tensors, metadata = [], {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            metadata.update(st.metadata() or {})
            for name in st.keys():
                sl = st.get_slice(name)
                shape = list(sl.get_shape())
                numel = 1
                for d in shape:
                    numel *= d
                tensors.append({"name": name, "dtype": sl.get_dtype(), "shape": shape, "numel": numel})
    return {"path": str(path), "metadata": metadata, "tensors": tensors,
            "total_params": sum(t["numel"] for t in tensors)}


def cmd_inspect(args) -> int:
    path = args.path
    if path.is_dir() and not list(path.glob("*.safetensors")):
        info = dcp_tools.inspect_dcp(dcp_tools.resolve(path))
    else:
        info = inspect_safetensors(path)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{info['path']}  {info['metadata']}")
    for t in info["tensors"]:
        print(f"  {t['name']:64s} {t['dtype']:9s} {t['shape']}")
    print(f"{len(info['tensors'])} tensors, {info['total_params']:,} model parameters")
    return 0


def checkpoint_root(path: Path) -> Path:
    """The ``ckpt/`` root of ``path``: itself, or ``<path>/ckpt`` for a run directory."""
    return path / "ckpt" if not store.committed(path) and (path / "ckpt").is_dir() else path


def cmd_verify(args) -> int:
    dirs = [args.path] if dcp_tools.is_dcp(args.path) else [p for _, p in store.committed(checkpoint_root(args.path))]
    if not dirs:
        print(f"error: no committed checkpoint under {args.path}", file=sys.stderr)
        return 1
    bad = 0
    for d in dirs:
        problems = store.verify(d)
        bad += bool(problems)
        print(f"{d}: {'OK' if not problems else 'DAMAGED'}")
        for p in problems:
            print(f"  {p}")
    return 1 if bad else 0


def cmd_to_hf(args) -> int:
    ckpt = dcp_tools.resolve(args.ckpt)
    problems = store.verify(ckpt)
    if problems:
        detail = "\n  ".join(problems[:10])
        if not args.force:
            print(f"error: {ckpt} is DAMAGED; refusing to convert it (--force converts anyway):\n  {detail}",
                  file=sys.stderr)
            return 1
        print(f"WARNING: converting the DAMAGED checkpoint {ckpt} because of --force; the weights may be "
              f"wrong:\n  {detail}", file=sys.stderr)
    out = dcp_tools.to_hf(ckpt, args.base_model or dcp_tools.base_model_of(ckpt), args.out)
    print(f"wrote {out} from {ckpt}")
    return 0


def cmd_prune(args) -> int:
    root = checkpoint_root(args.root)
    if not store.committed(root):
        print(f"error: no committed checkpoint under {args.root}", file=sys.stderr)
        return 1
    if args.keep_last < 1 and not args.force:
        print("error: --keep-last must be at least 1 (--force with --keep-last 0 keeps only the newest valid "
              "checkpoint and those --keep-every names)", file=sys.stderr)
        return 2
    removed = store.prune(root, args.keep_last, args.keep_every, full_check=True)
    for p in removed:
        print(f"removed {p}")
    print(f"kept steps {[s for s, _ in store.committed(root)]} in {root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_tools", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="list tensors, shapes, dtypes and metadata")
    p.add_argument("path", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("verify", help="check every file of a checkpoint against its manifest")
    p.add_argument("path", type=Path)
    p = sub.add_parser("to-hf", help="convert a checkpoint to a HuggingFace folder")
    p.add_argument("ckpt", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--base-model", type=Path, help="folder with config.json and tokenizer (default: the run's)")
    p.add_argument("--force", action="store_true", help="convert even a checkpoint that verify rejects")
    p = sub.add_parser("prune", help="delete checkpoints beyond a retention policy")
    p.add_argument("root", type=Path)
    p.add_argument("--keep-last", type=int, required=True)
    p.add_argument("--keep-every", type=int, default=0)
    p.add_argument("--force", action="store_true", help="allow --keep-last 0")
    args = parser.parse_args(argv)
    for attr in ("path", "ckpt", "root"):
        if hasattr(args, attr) and not getattr(args, attr).exists():
            print(f"error: {getattr(args, attr)} does not exist", file=sys.stderr)
            return 2
    return {"inspect": cmd_inspect, "verify": cmd_verify, "to-hf": cmd_to_hf, "prune": cmd_prune}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
