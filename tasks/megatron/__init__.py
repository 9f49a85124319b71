"""Megatron-core glue: CPU compatibility, process groups, models from HF configs, weight conversion.

Import the submodules directly; they import megatron-core lazily (it takes seconds to import).
"""
