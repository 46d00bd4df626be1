"""Make a token file for workloads/tokens.py from any text: byte-level tokens (0-255), written
as a flat little-endian uint16 array, the format nanoGPT's prepare scripts write (train.bin).

    python scripts/make_tokens.py README.md docs/*.md -o /tmp/tokens.bin
    python scripts/make_tokens.py --repeat 20 README.md -o /tmp/tokens.bin   # a larger file

Byte-level tokens need no tokenizer download and fit any vocabulary of 256 or more.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def tokens_of(paths: list[Path], repeat: int) -> np.ndarray:
    """The bytes of every file, concatenated `repeat` times, as uint16 tokens."""
    data = b"".join(p.read_bytes() for p in paths) * repeat
    return np.frombuffer(data, dtype=np.uint8).astype("<u2")


def main(argv: list[str] | None = None) -> int:
    """Write the token file; one line on stderr and exit 2 for an unreadable or empty input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="+", type=Path, help="text files to tokenize")
    parser.add_argument("-o", "--out", type=Path, required=True, help="the .bin file to write")
    parser.add_argument("--repeat", type=int, default=1, help="concatenate the text N times")
    args = parser.parse_args(argv)
    try:
        tokens = tokens_of(args.text, max(1, args.repeat))
    except OSError as e:
        print(f"make_tokens: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    if tokens.size == 0:
        print("make_tokens: the input is empty; give a file with some text", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(args.out)
    print(f"{args.out}: {tokens.size:,} tokens (uint16, byte-level, vocabulary 256)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
