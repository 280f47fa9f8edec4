"""The fusion engine. Imports torch and transformers only."""
