"""``koochak-report RUN [RUN ...]``: one run's story (`koochak.loop.report`), or several runs side
by side (`koochak.loop.compare`). The command lives here, above both, so neither imports the other
back."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from koochak.loop.compare import write_comparison
from koochak.loop.report import EXIT_USAGE, ReportError, write_report

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="koochak-report",
        description="Render a koochak-train run directory (all attempts) as a PNG and an HTML page.",
    )
    parser.add_argument("run_dir", nargs="+", metavar="RUN_DIR",
                        help="the run's train.out_dir; several: compare them side by side")  # fmt: skip
    parser.add_argument("--out", default=None, help="output prefix (default RUN_DIR/report; "
                        "for several runs ./koochak-compare)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if len(args.run_dir) > 1:
            png, page = write_comparison(args.run_dir, args.out)
        else:
            png, page = write_report(args.run_dir[0], args.out)
    except (ReportError, OSError) as exc:
        print(f"koochak-report: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    print(f"koochak-report: wrote {png} and {page}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
