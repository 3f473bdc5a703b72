"""``python -m ckpt_tools inspect PATH``: what is inside a safetensors file or folder."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import safe_open


def safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"error: no .safetensors files in {path}")
    return files


def inspect(path: Path) -> dict:
    tensors, metadata = [], {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            metadata.update(st.metadata() or {})
            for name in st.keys():
                sl = st.get_slice(name)
                shape = list(sl.get_shape())
                dtype = sl.get_dtype()
                numel = 1
                for d in shape:
                    numel *= d
                tensors.append({"name": name, "dtype": dtype, "shape": shape, "numel": numel, "file": f.name})
    return {"path": str(path), "metadata": metadata, "tensors": tensors,
            "total_params": sum(t["numel"] for t in tensors)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="list tensors, shapes, dtypes and metadata")
    p.add_argument("path", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if not args.path.exists():
        print(f"error: {args.path} does not exist", file=sys.stderr)
        return 2
    info = inspect(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{info['path']}  metadata={info['metadata']}")
    for t in info["tensors"]:
        print(f"  {t['name']:60s} {t['dtype']:8s} {str(t['shape']):20s}")
    print(f"{len(info['tensors'])} tensors, {info['total_params']:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
