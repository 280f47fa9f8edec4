"""Tokens from the fused KV: sampling and decoding, batched decoding, an answer's start, and the
prefix tier of recent prompts and answers. Imports model/ and fusion/.
"""
