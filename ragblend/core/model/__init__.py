"""The model: loading (the embedded default, a GGUF file, an HF directory), the linear layers and
kernels its weights run on, and :class:`~.adapter.ModelAdapter`, one decoder layer as small steps.
Imports no other room of core/.
"""
