"""History pieces' cost on single-shot queries: a SmolLM2 query's CPU time with ``history_pieces`` on
(the default since pieces are kept only for conversations) and off, alternated.

``time.process_time()`` of ``generate`` + ``flush`` counts every thread's CPU, the background pass
included; the prompt is a flat 3-chunk prompt with a system prompt, found through ``find_chunks`` as a
framework sends it; the prefix tier is off so that every question is computed.

    python -m benchmarks.pieces_cost
"""

from __future__ import annotations

import statistics
import tempfile
import time

from ragblend import BlendEngine
from ragblend.data import load_sample

from .common import SYSTEM

QUESTIONS = ["Who runs public transport in Lowenmark?", "When was the first breakwater built?",
             "What happens on the first Saturday of September?", "Which museum is the oldest?",
             "How long is the ferry crossing?", "What is the town's main industry?"]


def main() -> None:
    chunks = load_sample()["chunks"]
    with tempfile.TemporaryDirectory() as kv_dir:
        engine = BlendEngine.from_pretrained(kv_dir=kv_dir, prefix_cache_bytes=0)
        engine.precompute(chunks)
        engine.flush()

        def prompt(question: str) -> str:
            return "Context:\n\n" + "\n\n".join(chunks[:3]) + f"\n\nQuestion: {question}"

        engine.generate(engine.find_chunks(prompt("warm up"), system=SYSTEM), max_new_tokens=32)
        engine.flush()
        cpu = {True: [], False: []}
        for round_ in range(2):
            for question in QUESTIONS:
                for pieces in ((True, False) if round_ == 0 else (False, True)):
                    engine.runner.pieces = pieces
                    t = time.process_time()
                    engine.generate(engine.find_chunks(prompt(question), system=SYSTEM), max_new_tokens=32)
                    engine.flush()
                    cpu[pieces].append(time.process_time() - t)
        for pieces in (False, True):
            v = cpu[pieces]
            print(f"history_pieces={pieces}: CPU s per query median {statistics.median(v):.3f} mean "
                  f"{statistics.mean(v):.3f} (n={len(v)}, min {min(v):.3f}, max {max(v):.3f}); "
                  f"pieces kept {len(engine.runner.piece_store)}")


if __name__ == "__main__":
    main()
