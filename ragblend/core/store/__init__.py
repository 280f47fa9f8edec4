"""Where chunks' KV live: :class:`~.kv.ChunkKV` and its key, the entry format, the memory and disk
tiers, what stored KV weighs, the chunk index and history pieces. Imports no other room.
"""
