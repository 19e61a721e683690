"""Write a patch that marks line ranges of a file as added, for `mutmut run --use-patch-file` (mutmut 2.x).

mutmut then mutates only those lines: how docs/mutation-testing.md restricts a run to the functions under test.

    python scripts/mutation_lines.py kube_vgpu/protocol/__init__.py 670-822 > /tmp/protocol.patch
"""

from __future__ import annotations

import sys


def patch(path: str, ranges: list[tuple[int, int]]) -> str:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    chosen = {n for low, high in ranges for n in range(low, high + 1)}
    old_count = sum(1 for n in range(1, len(lines) + 1) if n not in chosen)
    out = [f"--- {path}", f"+++ {path}", f"@@ -1,{old_count} +1,{len(lines)} @@"]
    out += [("+" if n in chosen else " ") + line for n, line in enumerate(lines, start=1)]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    ranges = []
    for text in argv[1:]:
        low, _, high = text.partition("-")
        ranges.append((int(low), int(high or low)))
    sys.stdout.write(patch(argv[0], ranges))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
