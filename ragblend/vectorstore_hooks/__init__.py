"""Ingestion hooks that precompute chunk KV as chunks enter a vector store."""
