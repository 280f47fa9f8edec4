"""The SQuAD-format prompts the benchmarks measure on (``squad:N`` in their ``--sets``): a question from
SQuAD-shifts' Reddit set (../shared/data, CC BY 4.0), its paragraph and 5 others, shuffled. The samples
and SQuAD's F1 / exact match live in :mod:`benchmarks.common`; this prints the first samples.

    python -m benchmarks.squad 5
"""

from __future__ import annotations

import sys

from .common import rag_samples


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for sample in rag_samples(int(argv[0]) if argv else 3):
        print(f"{sample['question']} -> {sample['answers']} (gold chunk {sample['gold']})")


if __name__ == "__main__":
    main()
