import argparse
from pathlib import Path

from export.train.pipeline import main

parser = argparse.ArgumentParser(prog="python -m export.train", description="Train unispec's bundled tiny models.")
parser.add_argument("--out", type=Path, default=Path("models"))
parser.add_argument("--only", nargs="*", help="stage names to (re)build, e.g. llama3 llama3-dflash")
args = parser.parse_args()
main(args.out, args.only)
