"""Each model's recompute budget, measured against its own order noise: the search
(:mod:`.search`), its stored result (:mod:`.record`) and the KL measures the benchmarks
share (:mod:`.metrics`). Imports fusion/ and decode/.
"""
