"""A prompt's KV from stored chunks: precomputing chunks (:mod:`.ingest`), the strategies and the
selection of the tokens to recompute, the layer-wise fused prefill, the layer source that
prefetches stored KV, the cost model and the loading controller. Imports model/ and store/.
"""
